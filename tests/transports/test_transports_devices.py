"""Which transport a tensor's device takes, and what is staged through host memory.

The decisions of :mod:`gradhub.transports.choice` (``apart``, ``select`` with a
device) and :mod:`gradhub.collective.staging` (``staged``, ``placement``) are
checked on stand-in groups (torch devices need no GPU to be named); the copies
themselves need CUDA (``tests/gpu/test_gpu_gloo.py``). A real 2-rank job on a
group named per device (``"cpu:gloo,cuda:gloo"``: gloo standing in for NCCL,
which this machine lacks) checks that CPU tensors of such a group still take
shared memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import gradhub
from gradhub.collective import all_gather, all_reduce, reduce_scatter
from gradhub.collective.staging import begin, placement, staged
from gradhub.transports import checks_in, chosen, select
from gradhub.transports.choice import apart
from gradhub.transports.native import NativeTransport
from gradhub.transports.operation import Operation
from gradhub.transports.p2p_ring import RingTransport
from gradhub.transports.shm import supported
from gradhub.transports.stores import device_backends
from harness import run_ranks

CPU, GPU0, GPU1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)


class StandIn:
    """What choice.py and staging.py read of a CollectiveGroup (and the
    transports they make, on construction: rank and size)."""

    def __init__(self, backend: str, world_size: int = 2, transport: str | None = None) -> None:
        self.backend, self.world_size, self.transport = backend, world_size, transport
        self.rank = 0
        self.backends = device_backends(backend)
        self.device = CPU if "cpu" in self.backends else GPU0
        self.transport_choice: Any = None
        self.device_transport: Any = None
        self.closers: list[Callable[[], None]] = []

    def backend_of(self, device: torch.device) -> str | None:
        return self.backends.get(device.type)

    def on_close(self, fn: Callable[[], None]) -> None:
        self.closers.append(fn)


def test_cuda_tensors_of_a_group_with_nccl_take_a_transport_of_their_own() -> None:
    both = StandIn("cpu:gloo,cuda:nccl")
    assert apart(both, GPU0) and not apart(both, CPU)  # type: ignore[arg-type]
    op = Operation("all_reduce", 1, 10.0, float("inf"))
    cuda = select(both, op, GPU0)  # type: ignore[arg-type]
    # NCCL's own collectives (the ring transport's NCCL path), with no store exchange.
    assert isinstance(cuda, RingTransport) and both.device_transport is cuda
    assert select(both, op, GPU1) is cuda and both.transport_choice is None  # type: ignore[arg-type]
    assert checks_in(both, GPU0)  # type: ignore[arg-type]
    both.closers[0]()  # the group's close releases it
    assert both.device_transport is None
    asked = StandIn("cpu:gloo,cuda:nccl", transport="gloo")
    assert isinstance(select(asked, op, GPU0), NativeTransport)  # type: ignore[arg-type]
    # One rank: nothing travels, one transport for every device; NCCL alone:
    # CUDA is the group's own device.
    for group in (StandIn("cpu:gloo,cuda:nccl", world_size=1), StandIn("nccl")):
        assert not apart(group, GPU0)  # type: ignore[arg-type]


def test_cuda_tensors_of_a_group_that_carries_host_memory_are_staged() -> None:
    gloo, both, nccl = StandIn("gloo"), StandIn("cpu:gloo,cuda:nccl"), StandIn("nccl")
    assert staged(gloo, GPU1)  # type: ignore[arg-type]
    assert staged(StandIn("cpu:gloo,cuda:gloo"), GPU0)  # type: ignore[arg-type]
    assert not staged(StandIn("gloo", world_size=1), GPU0)  # type: ignore[arg-type]
    for group, device in ((gloo, CPU), (both, GPU0), (both, CPU), (nccl, GPU0)):
        assert not staged(group, device)  # type: ignore[arg-type]
    # Where an operation's tensors go: their own device where it is carried or
    # staged; a CPU tensor on NCCL alone moves to the group's GPU, as before.
    assert placement(gloo, GPU1) == GPU1 and placement(both, CPU) == CPU  # type: ignore[arg-type]
    assert placement(nccl, CPU) == GPU0 and placement(gloo, CPU) == CPU  # type: ignore[arg-type]
    assert placement(gloo, torch.device("meta")) == CPU  # type: ignore[arg-type]
    assert begin(gloo, torch.zeros(3)) is None and begin(gloo) is None  # type: ignore[arg-type]


def mixed_job(rank: int, world_size: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    dist.init_process_group("cpu:gloo,cuda:gloo")  # env:// from the harness
    with gradhub.init(timeout=60) as runtime:
        group = runtime.group
        x = torch.arange(10.0) * (rank + 1)
        summed = all_reduce(x.clone(), group=group).wait()
        mine = reduce_scatter(x, group=group)
        whole = all_gather(mine, x.numel(), group=group)
        out = {
            "transport": chosen(group),
            "device_transport": group.device_transport,
            "summed": summed.tolist(),
            "whole": whole.tolist(),
            "device": str(runtime.device),
        }
    dist.destroy_process_group()
    return out


@pytest.mark.slow
@pytest.mark.skipif(not supported(), reason="needs memfd shared memory")
def test_cpu_tensors_of_a_group_named_per_device_take_shared_memory() -> None:
    results = run_ranks(mixed_job, 2, timeout=120)
    want = (torch.arange(10.0) * 3).tolist()
    for r in results:
        assert r.value["transport"] == "shm" and r.value["device_transport"] is None
        assert r.value["summed"] == r.value["whole"] == want
        assert r.value["device"] == "cpu"
