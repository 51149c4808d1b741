"""Two ranks' small all-reduce on shared memory, through the gradhub backend,
with its C part (gradhub._shm.native.all_reduce_pair) and without it
(``GRADHUB_NATIVE=0``: the transport's Python steps): the sum's bits (fp32:
``rank 0's + rank 1's``; bf16: widened, added, rounded once, as ATen adds two
bf16 tensors), special values included, and a dead peer named at once."""

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
SIZES = [0, 1, 7, 1001, 65536]


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


def pair_job(rank: int, world_size: int, native_on: bool) -> dict[str, Any]:
    torch.set_num_threads(1)
    if not native_on:
        os.environ["GRADHUB_NATIVE"] = "0"
    loaded = native.available()  # the build or load has ended: the C part is used or not
    calls: list[int] = []
    pair = native.all_reduce_pair

    def counted(*args: Any) -> bool:
        calls.append(1)
        return pair(*args)

    native.all_reduce_pair = counted  # type: ignore[assignment] (this process only)
    init(rank, world_size)
    differ = []
    for dtype in (torch.float32, torch.bfloat16):
        for n in SIZES:
            x = values(rank, n, dtype)
            dist.all_reduce(x)
            if not same_bits(x, torch.add(values(0, n, dtype), values(1, n, dtype))):
                differ.append(f"{dtype} {n} sum")
            y = values(rank, n, dtype)
            dist.all_reduce(y, op=dist.ReduceOp.AVG)
            if not same_bits(y, torch.add(values(0, n, dtype), values(1, n, dtype)) / 2):
                differ.append(f"{dtype} {n} avg")
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
        "differ": differ,
        "error": error,
        "elapsed": time.monotonic() - begin,
    }


@pytest.mark.parametrize("native_on", [True, False], ids=["C", "Python"])
def test_two_ranks_small_all_reduce_bits_and_a_dead_peer(native_on: bool) -> None:
    if native_on and shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler")
    results = run_ranks(pair_job, 2, native_on, timeout=120, check=False)
    assert results[1].exitcode == -signal.SIGKILL
    r = results[0]
    assert r.ok, r.error
    assert r.value["loaded"] == native_on
    # Every one of the 20 calls (2 dtypes, 5 sizes, sum and average) in C, or none.
    assert r.value["calls"] == (2 * len(SIZES) * 2 if native_on else 0), r.value
    assert r.value["differ"] == [], r.value["differ"]
    assert r.value["error"].startswith("WorkerFailedError"), r.value["error"]
    assert "rank 1" in r.value["error"], r.value["error"]
    assert r.value["elapsed"] < 15  # the pidfd check, not the group's 60 s timeout
