"""Two ranks on two GPUs (skipped below 2 GPUs): the default group carries
CUDA tensors on NCCL and CPU tensors on gloo's side (shared memory), and the
strategies train as DDP on NCCL does in the same processes: ``allreduce`` bit
for bit (two ranks: one sum, and a halving that is exact), ``sharded`` within
float32 rounding; a collective queued behind another starts, on the device,
after the work its caller queued on its own CUDA stream."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_jobs import ddp_beside_job
from harness import run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL: one per rank)"),
]


def test_strategies_beside_ddp_on_two_gpus() -> None:
    results = run_ranks(ddp_beside_job, 2, timeout=240)
    for r in results:
        out = r.value
        assert out["backend"] == "cpu:gloo,cuda:nccl"
        for a, b in zip(out["allreduce"], out["ddp"], strict=True):
            assert np.array_equal(a, b)
        for a, b in zip(out["sharded"], out["ddp"], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        assert out["cpu"] == ([2.0] * 8, "shm")
        assert out["cuda"] == ([2.0] * 8, "ring")
        assert out["stream"] == [3.0]  # rank 0's 1 + rank 1's 2, after their producers
