"""Groups that cannot carry a model's device say so, with what to use instead."""

from __future__ import annotations

import pytest
import torch

from gpu_jobs import gradhub_backend_job, nccl_alone_job
from harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_the_gradhub_backend_refuses_cuda_tensors_and_models() -> None:
    out = run_ranks(gradhub_backend_job, 1, timeout=120)[0].value
    assert "CPU tensors" in out["backend"] and "NCCL" in out["backend"], out["backend"]
    assert out["prepare"].startswith("DevicePlacementError"), out["prepare"]
    assert "'gradhub'" in out["prepare"] and "backend='gloo'" in out["prepare"]


def test_nccl_alone_refuses_a_cpu_model_and_another_gpu() -> None:
    out = run_ranks(nccl_alone_job, 1, timeout=120)[0].value
    assert out["cpu model"].startswith("DevicePlacementError"), out["cpu model"]
    assert "CUDA tensors only" in out["cpu model"]
    if torch.cuda.device_count() > 1:
        assert "this rank's GPU is cuda:0" in out["another gpu"], out["another gpu"]
