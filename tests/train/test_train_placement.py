"""``gradhub.prepare`` keeps the model where the script put it, and refuses a
device the job's group cannot carry (:mod:`gradhub.train.placement`).

The decisions for CUDA models are checked on device names (no GPU needed);
CUDA models themselves are trained in ``tests/gpu/``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import gradhub
from gradhub.errors import DevicePlacementError, GradhubError
from gradhub.train.placement import check_device
from train_helpers import fixed_data, tiny_model

CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
GLOO = {"cpu": "gloo"}
NCCL = {"cuda": "nccl"}
BOTH = {"cpu": "gloo", "cuda": "nccl"}
GRADHUB = {"cpu": "gradhub"}


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[gradhub.Runtime]:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    with gradhub.init(timeout=30) as rt:  # a job of one on this machine's default group
        yield rt
    assert not dist.is_initialized()


def test_a_cpu_model_stays_on_the_cpu_under_every_synchronous_strategy(
    runtime: gradhub.Runtime,
) -> None:
    x, y = fixed_data()
    for strategy in ("allreduce", "sharded"):
        model = tiny_model()
        first = next(model.parameters())
        prepared, opt = gradhub.prepare(
            model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy, runtime=runtime
        )
        torch.nn.functional.cross_entropy(prepared(x), y).backward()
        opt.step()
        assert {p.device for p in model.parameters()} == {CPU}
        assert {p.grad.device for p in model.parameters() if p.grad is not None} == {CPU}
        if strategy == "allreduce":
            assert next(model.parameters()) is first  # the script's own tensors
        prepared.close()


def test_a_model_without_values_or_on_several_devices_is_refused_at_prepare(
    runtime: gradhub.Runtime,
) -> None:
    meta = torch.nn.Linear(3, 2, device="meta")
    split = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2, device="meta"))
    for model, why in ((meta, "meta device"), (split, "several devices \\(cpu, meta\\)")):
        with pytest.raises(DevicePlacementError, match=why) as info:
            gradhub.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), runtime=runtime)
        error = info.value
        assert isinstance(error, GradhubError) and isinstance(error, ValueError)
        assert "- help:" in str(error)
    # nothing moved it either
    assert {p.device.type for p in split.parameters()} == {"cpu", "meta"}


def test_where_each_group_trains_a_model() -> None:
    # Taken: CPU models wherever the group carries CPU tensors; CUDA models on
    # this rank's GPU under NCCL, and anywhere under gloo (staged through host memory).
    for device, rank_device, backends in [
        (CPU, CPU, GLOO),
        (CPU, GPU0, BOTH),
        (CPU, CPU, GRADHUB),
        (GPU0, GPU0, NCCL),
        (GPU1, GPU1, BOTH),
        (GPU0, CPU, GLOO),
        (GPU1, CPU, {"cpu": "gloo", "cuda": "gloo"}),
    ]:
        check_device(device, rank_device, backends, "-")
    refused = [
        (
            CPU,
            GPU0,
            NCCL,
            "(?s)carries CUDA tensors only.*model.to\\(runtime.device\\) \\(cuda:0\\)",
        ),
        (GPU1, GPU0, NCCL, "on cuda:1, but this rank's GPU is cuda:0"),
        (GPU0, GPU1, BOTH, "on cuda:0, but this rank's GPU is cuda:1"),
        (GPU0, CPU, GRADHUB, "(?s)carries CPU tensors only.*backend='gloo'"),
        (torch.device("meta"), CPU, GLOO, "meta device"),
    ]
    for device, rank_device, backends, why in refused:
        with pytest.raises(DevicePlacementError, match=why) as info:
            check_device(device, rank_device, backends, "the group")
        assert "- help:" in str(info.value)
