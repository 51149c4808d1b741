"""Rank functions: a local error is refused on the calling rank and the group stays usable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from backend_jobs import _data, init

from gradhub.errors import CollectiveArgumentError

R = dist.ReduceOp


def _refused(call: Callable[[], Any]) -> str:
    """The message of the CollectiveArgumentError ``call`` raises from the call
    itself (``async_op=True``: nothing was queued either)."""
    try:
        call()
    except CollectiveArgumentError as exc:
        assert isinstance(exc, RuntimeError) and isinstance(exc, ValueError)  # gloo's and ours
        return str(exc)
    raise AssertionError("not refused")


def _one_sided(rank: int, world: int) -> dict[str, str]:
    """Bad calls that only rank 0 makes: had it sent or numbered anything, the
    collectives that follow would not meet the other ranks' ones."""
    e, f = torch.empty, torch.ones
    calls: dict[str, Callable[[], Any]] = {
        "float BAND": lambda: dist.all_reduce(f(4), op=R.BAND, async_op=True),
        "int PREMUL_SUM": lambda: dist.all_reduce(
            f(4, dtype=torch.int32), op=dist._make_nccl_premul_sum(2.0), async_op=True
        ),
        "uint16": lambda: dist.all_reduce(f(4, dtype=torch.uint16), async_op=True),
        "all_gather size": lambda: dist.all_gather_into_tensor(e(4 * world + 1), e(4)),
        "all_gather count": lambda: dist.all_gather([e(4)] * (world + 1), e(4)),
        "reduce_scatter size": lambda: dist.reduce_scatter_tensor(e(4), e(4 * world + 2)),
        "reduce_scatter int AVG": lambda: dist.reduce_scatter_tensor(
            e(4, dtype=torch.int64), e(4 * world, dtype=torch.int64), op=R.AVG
        ),
        "broadcast root": lambda: dist.broadcast(e(4), src=world),
        "all_to_all splits": lambda: dist.all_to_all_single(e(4), e(4), [1] * world, [2] * world),
        "all_to_all sizes": lambda: dist.all_to_all_single(e(4), e(6)),
        "reduce int AVG": lambda: dist.reduce(f(4, dtype=torch.int64), dst=0, op=R.AVG),
    }
    return {name: _refused(call) for name, call in calls.items()} if rank == 0 else {}


def _collectives(rank: int, world: int) -> dict[str, Callable[[Any], list[torch.Tensor]]]:
    """Ten collectives of various kinds, each run on the gradhub group (``None``) or gloo."""

    def all_reduce(g: Any) -> list[torch.Tensor]:
        t = _data(rank, torch.float32)
        dist.all_reduce(t, group=g)
        return [t]

    def all_reduce_bf16_avg(g: Any) -> list[torch.Tensor]:
        t = _data(rank, torch.bfloat16)
        dist.all_reduce(t, op=R.AVG, group=g)
        return [t]

    def all_reduce_int64_max(g: Any) -> list[torch.Tensor]:
        t = _data(rank, torch.int64)
        dist.all_reduce(t, op=R.MAX, group=g)
        return [t]

    def broadcast(g: Any) -> list[torch.Tensor]:
        a, b = _data(rank, torch.float32), _data(rank, torch.int64)
        dist.broadcast(a, src=world - 1, group=g)
        dist.broadcast(b, src=0, group=g)
        return [a, b]

    def all_gather(g: Any) -> list[torch.Tensor]:
        t = _data(rank, torch.float16, 10)
        out = torch.empty(10 * world, dtype=torch.float16)
        dist.all_gather_into_tensor(out, t, group=g)
        return [out]

    def all_gather_list(g: Any) -> list[torch.Tensor]:
        t = _data(rank, torch.int32, 7)
        outs = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(outs, t, group=g)
        return outs

    def reduce_scatter(g: Any) -> list[torch.Tensor]:
        out = torch.empty(12)
        dist.reduce_scatter_tensor(out, _data(rank, torch.float32, 12 * world), group=g)
        return [out]

    def all_to_all(g: Any) -> list[torch.Tensor]:
        inp = _data(rank, torch.float32, 4 * world)
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp, group=g)
        return [out]

    def reduce(g: Any) -> list[torch.Tensor]:
        t = _data(rank, torch.float64, 8)
        dist.reduce(t, dst=0, group=g)
        return [t] if rank == 0 else []

    def barrier_then_all_reduce(g: Any) -> list[torch.Tensor]:
        dist.barrier(group=g)
        t = _data(rank + 5, torch.float32, 33)
        dist.all_reduce(t, op=R.AVG, group=g)
        return [t]

    return {f.__name__: f for f in (all_reduce, all_reduce_bf16_avg, all_reduce_int64_max,
                                      broadcast, all_gather, all_gather_list, reduce_scatter,
                                      all_to_all, reduce, barrier_then_all_reduce)}  # fmt: skip


def local_errors_keep_the_group(rank: int, world: int) -> dict[str, Any]:
    """An int64 AVG raises the typed error on every rank, from the call; bad calls
    of one rank alone too; then ten collectives on the same group give gloo's results."""
    init(rank, world)
    gloo = dist.new_group(backend="gloo")
    dist.all_reduce(torch.ones(4))  # the transports are set up
    avg = _refused(
        lambda: dist.all_reduce(torch.ones(4, dtype=torch.int64), op=R.AVG, async_op=True)
    )
    one_sided = _one_sided(rank, world)
    checked = []
    for name, run in _collectives(rank, world).items():
        ours, theirs = run(None), run(gloo)
        for a, b in zip(ours, theirs, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), name
        checked.append(name)
    chosen = dist.group.WORLD.transport  # type: ignore[union-attr]
    dist.destroy_process_group()
    return {"avg": avg, "one sided": one_sided, "checked": checked, "transport": chosen}
