"""gradhub.runtime in one process: defaults, adopted groups, set-up errors, a lost store."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import gradhub
from gradhub.collective import CollectiveGroup, all_reduce
from gradhub.errors import (
    GradhubError,
    GradhubTimeoutError,
    LaunchEnvironmentError,
    StateError,
    WorkerFailedError,
)
from gradhub.runtime import BOTH, DEFAULT_TIMEOUT, free_loopback_port, local_group, pick_backend
from gradhub.transports.stores import device_backends

LAUNCH = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def plain_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key in LAUNCH:
        monkeypatch.delenv(key, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_plain_process_is_a_job_of_one_with_the_default_timeout() -> None:
    with gradhub.init() as runtime:
        assert (runtime.rank, runtime.world_size, runtime.is_main) == (0, 1, True)
        assert runtime.timeout == runtime.group.timeout == DEFAULT_TIMEOUT
        assert runtime.owns_group and dist.is_initialized()
    assert not dist.is_initialized()  # it created the group, so it destroyed it
    with pytest.raises(ValueError, match="timeout"):
        gradhub.init(timeout=0)


def test_an_unknown_transport_is_refused_before_anything_is_set_up() -> None:
    with pytest.raises(ValueError, match="transport= must be one of auto, shm, hierarchical"):
        gradhub.init(transport="carrier-pigeon")
    assert not dist.is_initialized()


def test_a_group_the_user_made_keeps_its_own_timeout() -> None:
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=8)
    )
    with gradhub.init() as runtime:
        assert runtime.timeout == runtime.group.timeout == 8.0
        assert not runtime.owns_group
    assert dist.is_initialized()  # not this runtime's to destroy
    with gradhub.init(timeout=2.5) as runtime:  # an explicit timeout wins
        assert runtime.group.timeout == 2.5


def test_an_incomplete_launch_environment_names_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(LaunchEnvironmentError, match="MASTER_ADDR, MASTER_PORT not set") as info:
        gradhub.init()
    assert isinstance(info.value, GradhubError) and isinstance(info.value, ValueError)
    assert not dist.is_initialized()


def test_a_peer_that_never_comes_is_a_rendezvous_timeout() -> None:
    port = free_loopback_port()
    begin = time.monotonic()
    with pytest.raises(GradhubTimeoutError, match=f"127.0.0.1:{port} within 1s") as info:
        local_group(0, 2, port, timeout=1.0)
    # Bounded by the timeout (asserted loosely: a loaded machine is slow).
    assert time.monotonic() - begin < 30
    assert "- help:" in str(info.value)
    assert isinstance(info.value.__cause__, RuntimeError)  # c10d's, kept as the cause
    assert not dist.is_initialized()


def test_a_check_in_to_a_store_whose_host_is_gone_names_the_store() -> None:
    port = free_loopback_port()
    kw = {"wait_for_workers": False, "timeout": timedelta(seconds=5)}
    host = dist.TCPStore("127.0.0.1", port, None, is_master=True, **kw)  # type: ignore[arg-type]
    client = dist.TCPStore("127.0.0.1", port, None, is_master=False, **kw)  # type: ignore[arg-type]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.group.WORLD is not None
    group = CollectiveGroup(dist.group.WORLD, store=client, timeout=5.0)
    try:
        group.begin("first")  # checks in
        del host  # its server goes with it: the host process died
        gc.collect()
        with pytest.raises(
            WorkerFailedError, match=f"cannot check in to .*127.0.0.1:{port}"
        ) as info:
            for _ in range(3):  # a send may still be taken before the reset is seen
                group.begin("put_gradients")
        assert isinstance(info.value.__cause__, RuntimeError)  # c10d's, kept as the cause
        with pytest.raises(StateError, match="unreachable"):  # out of step now: broken
            group.begin("next")
    finally:
        group.close()


def test_the_default_backend_serves_cpu_and_cuda_where_there_is_cuda(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert pick_backend(None) == pick_backend(None, 2) == BOTH == "cpu:gloo,cuda:nccl"
    # NCCL takes one GPU per rank: more ranks on this host than GPUs is gloo.
    assert pick_backend(None, 3) == "gloo"
    assert [pick_backend(b) for b in ("gloo", "nccl", BOTH)] == ["gloo", "nccl", BOTH]
    with pytest.raises(ValueError, match="must be one of gloo, nccl, cpu:gloo,cuda:nccl"):
        pick_backend("mpi")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_backend(None) == "gloo"
    for wanted in ("nccl", BOTH):
        with pytest.raises(ValueError, match="needs CUDA"):
            pick_backend(wanted)


def test_which_backend_carries_which_device() -> None:
    assert device_backends("cpu:gloo,cuda:nccl") == {"cpu": "gloo", "cuda": "nccl"}
    assert device_backends("nccl") == {"cuda": "nccl"}
    assert device_backends("gloo") == {"cpu": "gloo"}
    assert device_backends("gradhub") == {"cpu": "gradhub"}


def test_a_group_of_two_backends_keeps_cpu_tensors_on_the_cpu() -> None:
    # What init_process_group() makes by default on a CUDA machine, with gloo
    # standing in for NCCL (this machine has no CUDA): torch names it by device.
    dist.init_process_group("cpu:gloo,cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    with gradhub.init() as runtime:
        assert runtime.backend == "cpu:gloo,cuda:gloo"
        assert runtime.group.backends == {"cpu": "gloo", "cuda": "gloo"}
        # CPU tensors stay on the CPU; the runtime's device is a GPU only under NCCL.
        assert runtime.group.device == runtime.device == torch.device("cpu")
        x = torch.arange(4.0)
        assert torch.equal(all_reduce(x, group=runtime.group).wait(), torch.arange(4.0))


def test_a_group_with_nccl_for_cuda_gives_this_ranks_gpu_as_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The runtime's decision alone (no GPU here): a group that carries CUDA
    # tensors on NCCL sends batches to GPU LOCAL_RANK % GPUs by default; its own
    # tensors (check-ins, flags) stay on the CPU, which gloo carries.
    dist.init_process_group("cpu:gloo,cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    chosen: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with gradhub.init() as runtime:
        assert runtime.backend == "cpu:gloo,cuda:nccl"
        assert runtime.device == torch.device("cuda", 1) and chosen == [runtime.device]
        assert runtime.group.device == torch.device("cpu")
        assert runtime.group.backend_of(torch.device("cuda", 1)) == "nccl"


def test_a_scripts_device_flag_names_this_ranks_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    with gradhub.init() as runtime:
        assert runtime.local_device("cpu") == torch.device("cpu")
        with pytest.raises(ValueError, match="'cpu' or 'cuda'"):
            runtime.local_device("cuda" if not torch.cuda.is_available() else "tpu")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        runtime.local_rank = 3
        assert runtime.local_device("cuda") == torch.device("cuda", 1)
