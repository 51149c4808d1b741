"""Rank functions: where the backend runs an operation (the calling thread or its worker)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from backend_jobs import init

from gradhub.backend.group_base import IN_PLACE_BYTES
from gradhub.backend.work import GradhubWork


def _where(order: list[tuple[str, int]], name: str) -> Callable[[], None]:
    """A body that records its name and the thread it ran on."""
    return lambda: order.append((name, threading.get_ident()))


def where_operations_run(rank: int, world_size: int) -> dict[str, Any]:
    init(rank, world_size)
    pg: Any = dist.distributed_c10d._get_default_group()
    me, order = threading.get_ident(), []
    seen: dict[str, Any] = {}

    # a small all-reduce through torch's API: done when the call returns, right
    x = torch.full((4,), float(rank + 1))
    work = dist.all_reduce(x, async_op=True)
    seen["small all_reduce done on return"] = work.is_completed()
    assert torch.equal(x, torch.full((4,), float(sum(range(1, world_size + 1)))))
    # its work (a DoneWork, made without lock, event or clock) answers as any
    done = pg.allreduce([x], dist.AllreduceOptions())
    seen["a done work answers as a pending one"] = (
        isinstance(done, GradhubWork)
        and done.wait(timedelta(seconds=1))
        and done.is_success()
        and done.exception() is None
        and done.result()[0] is x
        and done.get_future().done()
        and done.get_future().value()[0] is x
    )
    future = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    seen["its future done"] = future.done()
    assert torch.equal(future.wait()[0], torch.full((4,), float(world_size)))

    # idle worker, small: on this thread; larger than IN_PLACE_BYTES: on the worker
    pg._submit("small", [], _where(order, "small"), 4).wait()
    pg._submit("large", [], _where(order, "large"), IN_PLACE_BYTES + 1).wait()
    # queued behind a running operation: on the worker, after it
    release = threading.Event()
    slow = pg._submit("slow", [], lambda: (release.wait(30), _where(order, "slow")()))
    behind: GradhubWork = pg._submit("behind", [], _where(order, "behind"), 4)
    seen["queued one pending"] = not behind.is_completed()
    release.set()
    behind.wait()
    assert slow.is_completed()
    # another torch state than a fresh thread's: on the worker
    with torch.inference_mode():
        pg._submit("inference", [], _where(order, "inference"), 4).wait()

    # an error of one run in place comes from wait(), as a queued one's
    def fail() -> None:
        raise ZeroDivisionError("in place")

    failed = pg._submit("failed", [], fail, 4)
    seen["failed done on return"] = failed.is_completed()
    try:
        failed.wait()
    except ZeroDivisionError:
        seen["error from wait"] = not failed.is_success()
    seen["its future raises"] = False
    try:
        failed.get_future().wait()
    except RuntimeError as exc:  # torch's wrapping of a callback's error, message kept
        seen["its future raises"] = "ZeroDivisionError: in place" in str(exc)
    dist.destroy_process_group()
    return {
        "order": [name for name, _ in order],
        "here": [name for name, thread in order if thread == me],
        "seen": seen,
    }
