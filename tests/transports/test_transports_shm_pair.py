"""Two ranks' all-reduce on shared memory, through the gradhub backend, with its
C part (gradhub._shm.native: ``all_reduce_pair`` for one synchronisation,
``all_reduce_halves`` above it) and without it (``GRADHUB_NATIVE=0``: the
transport's Python steps): the sum's bits (fp32: ``rank 0's + rank 1's``;
bf16: widened, added, rounded once, as ATen adds two bf16 tensors), special
values included, also with the polls off (every wait the Python one, the C
part going on from where it stopped), and a dead peer named at once."""

from __future__ import annotations

import os
import shutil
import signal
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from backend_jobs import init

from gradhub._shm import native
from gradhub.transports import shm
from harness import run_ranks

pytestmark = pytest.mark.skipif(not shm.supported(), reason="needs memfd, pidfd and futex")

SPECIAL = {
    torch.float32: [float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-45, 3.4e38, -3.4e38],
    torch.bfloat16: [3.3e38, -3.3e38, 2.0**-133, 1.0, 2.0**-8, -0.0, 0.0, float("inf")],
}
SIZES = [0, 1, 7, 1001, 16384]  # at most shm.PAIR_ONE_SYNC_BYTES: one synchronisation
HALVES = {  # above it: in halves (odd lengths: halves of two lengths)
    torch.float32: [16385, 65536, 300_001],
    torch.bfloat16: [32769, 65536, 1_100_001],
}


def values(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Random values, the special ones first (rank 1's rolled by one, so each meets
    another)."""
    g = torch.Generator().manual_seed(10 * n + rank)
    x = (torch.randn(n, generator=g) * 10).to(dtype)
    special = torch.tensor(SPECIAL[dtype], dtype=dtype).roll(rank)[:n]
    x[: special.numel()] = special
    return x


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, but for a NaN's payload (a NaN stays a NaN)."""
    nan = a.isnan()
    if not torch.equal(nan, b.isnan()):
        return False
    bits = torch.int32 if a.dtype == torch.float32 else torch.int16
    return torch.equal(a[~nan].view(bits), b[~nan].view(bits))


def pair_job(rank: int, world_size: int, native_on: tuple[bool, bool]) -> dict[str, Any]:
    torch.set_num_threads(1)
    if not native_on[rank]:
        os.environ["GRADHUB_NATIVE"] = "0"
    loaded = native.available()  # the build or load has ended: the C part is used or not
    calls: list[int] = []
    pair = native.all_reduce_pair

    def counted(*args: Any) -> bool:
        calls.append(1)
        return pair(*args)

    halves: list[int] = []
    halved = native.all_reduce_halves

    def counted_halves(*args: Any) -> int:
        halves.append(args[-1])  # the stage it starts from
        return halved(*args)

    native.all_reduce_pair = counted  # type: ignore[assignment] (this process only)
    native.all_reduce_halves = counted_halves  # type: ignore[assignment]
    init(rank, world_size)
    differ = []
    for polls in (True, False):
        if not polls:  # every wait the Python one
            shm.Control.poll_budget = lambda self: 0.0  # type: ignore[method-assign]
        for dtype in (torch.float32, torch.bfloat16):
            for n in [*SIZES, *HALVES[dtype]]:
                x = values(rank, n, dtype)
                dist.all_reduce(x)
                if not same_bits(x, torch.add(values(0, n, dtype), values(1, n, dtype))):
                    differ.append(f"{dtype} {n} sum, polls {polls}")
                y = values(rank, n, dtype)
                dist.all_reduce(y, op=dist.ReduceOp.AVG)
                if not same_bits(y, torch.add(values(0, n, dtype), values(1, n, dtype)) / 2):
                    differ.append(f"{dtype} {n} avg, polls {polls}")
    summed = len(calls)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    begin = time.monotonic()
    try:
        dist.all_reduce(torch.ones(16))
        error = ""
    except Exception as exc:  # the peer's death, named
        error = f"{type(exc).__name__}: {exc}"
    return {
        "loaded": loaded,
        "calls": summed,
        "halves": sum(1 for stage in halves if stage == 0),
        "resumed": sum(1 for stage in halves if stage > 0),
        "differ": differ,
        "error": error,
        "elapsed": time.monotonic() - begin,
    }


@pytest.mark.parametrize(
    "modes", [(True, True), (False, False), (True, False)], ids=["C", "Python", "mixed"]
)
def test_two_ranks_all_reduce_bits_and_a_dead_peer(modes: tuple[bool, bool]) -> None:
    """``modes``: whether rank 0, rank 1 use the C part ("mixed": a peer whose
    build has not ended yet; both take the same steps)."""
    native_on = modes[0]
    if any(modes) and shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    results = run_ranks(pair_job, 2, modes, timeout=120, check=False)
    assert results[1].exitcode == -signal.SIGKILL
    r = results[0]
    assert r.ok, r.error
    assert r.value["loaded"] == native_on
    # Every one of the calls (2 rounds, 2 dtypes, 5 sizes, sum and average) in
    # C, or none; and each of the 24 larger ones in halves, which, with the
    # polls off, went on after a Python wait at least once.
    assert r.value["calls"] == (2 * 2 * len(SIZES) * 2 if native_on else 0), r.value
    assert r.value["halves"] == (2 * 2 * 3 * 2 if native_on else 0), r.value
    assert (r.value["resumed"] > 0) == native_on, r.value
    assert r.value["differ"] == [], r.value["differ"]
    assert r.value["error"].startswith("WorkerFailedError"), r.value["error"]
    assert "rank 1" in r.value["error"], r.value["error"]
    assert r.value["elapsed"] < 15  # the pidfd check, not the group's 60 s timeout


def halves_death_job(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1 (without the C part) publishes its first half, then dies; rank 0
    (with it) waits at the second synchronisation, in Python after its C call."""
    torch.set_num_threads(1)
    if rank == 1:
        os.environ["GRADHUB_NATIVE"] = "0"
    loaded = native.available()
    init(rank, world_size)
    dist.all_reduce(torch.ones(HALVES[torch.float32][-1]))  # both ranks whole
    if rank == 1:

        def die_half_way(self: Any, op: Any, k: int, *args: Any) -> None:
            self.publish(shm.ENTERED, k)
            os.kill(os.getpid(), signal.SIGKILL)

        shm.Control._halves = die_half_way  # type: ignore[method-assign] (this process only)
    dist.barrier()
    stages: list[int] = []
    halved = native.all_reduce_halves

    def recorded(*args: Any) -> int:
        stages.append(halved(*args))
        return stages[-1]

    native.all_reduce_halves = recorded  # type: ignore[assignment]
    begin = time.monotonic()
    try:
        dist.all_reduce(torch.ones(HALVES[torch.float32][-1]))
        error = ""
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    return {"loaded": loaded, "stages": stages, "error": error, "elapsed": time.monotonic() - begin}


def test_a_peer_dead_between_the_halves_is_named() -> None:
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    results = run_ranks(halves_death_job, 2, timeout=120, check=False)
    assert results[1].exitcode == -signal.SIGKILL
    r = results[0]
    assert r.ok, r.error
    assert r.value["loaded"]
    assert r.value["stages"][-1] == 2, r.value  # left C waiting for the peer's sum
    assert r.value["error"].startswith("WorkerFailedError"), r.value["error"]
    assert "rank 1" in r.value["error"], r.value["error"]
    assert r.value["elapsed"] < 15  # the pidfd check, not the group's 60 s timeout
