"""Two ranks on one GPU over gloo: CUDA tensors staged through pinned host memory.

NCCL refuses two ranks on one GPU, so a one-GPU machine runs a 2-rank job on
gloo (``backend="gloo"``, or the default where the host has fewer GPUs than
ranks). The collectives on CUDA tensors give the bits of the same calls on
CPU tensors (the same transport sums the same values), on the GPU, also for a
tensor made and read on a stream of the script's own; training a CUDA model
with ``allreduce`` and ``sharded`` keeps the replicas equal and matches plain
training on the global batch (float32 rounding: the halves' gradients are
summed, not the whole batch's).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_jobs import plain, staged_collectives_job, two_on_one_gpu_job
from harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_collectives_on_cuda_tensors_of_a_gloo_group_give_the_cpu_bits() -> None:
    results = run_ranks(staged_collectives_job, 2, timeout=180)
    for r in results:
        out = r.value
        assert out["backend"] == "gloo" and out["transport"] == "shm"
        for size in (7, 1000, 3_000_001):
            cpu, gpu = out[(size, "cpu")], out[(size, "cuda:0")]
            for a, b in zip(cpu, gpu, strict=True):
                assert np.array_equal(a, b), size
            assert out[(size, "cuda:0", "devices")] == {"cuda"}
        assert out["stream"] == [3.0]
        kind, gradient, weights = out["arp"]
        assert kind == "cuda" and gradient == [1.5]
        assert np.array_equal(weights, np.arange(1000, dtype=np.float32))


@pytest.mark.parametrize("strategy", ["allreduce", "sharded"])
def test_two_ranks_train_a_cuda_model_on_one_gpu(strategy: str) -> None:
    results = run_ranks(two_on_one_gpu_job, 2, strategy, timeout=180)
    want = plain(torch.device("cuda"), world=2)
    for r in results:
        assert r.value["device"] == "cuda:0"
        for got, ref in zip(r.value["params"], want, strict=True):
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5)
    for a, b in zip(results[0].value["params"], results[1].value["params"], strict=True):
        assert np.array_equal(a, b)
