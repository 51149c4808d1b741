"""The runtime's collectives are operations of its group, waited on their own future:
run in the group's order, a c10d work started elsewhere waited within the timeout,
and a rank that never enters one named (2 real ranks)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import gradhub
from gradhub.transports.group import CollectiveFuture
from harness import run_ranks


def _caught(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def _waits_job(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rt = gradhub.init(timeout=3.0)
    order: list[str] = []

    # Queued behind an operation of the group submitted before it: the group's order.
    def slow() -> None:
        time.sleep(0.3)
        order.append("group operation")

    queued = rt.group.submit("slow", slow)
    x = torch.tensor([float(rank + 1)])
    future = rt.collective("all_reduce", lambda: dist.all_reduce(x, async_op=True), where="a test")
    out["own future"] = isinstance(future, CollectiveFuture)
    rt.wait(future)
    order.append("runtime collective")
    queued.wait()
    out["order"] = order
    out["sum"] = x.item()

    # A c10d work item started outside the group: waited as an operation of it.
    y = torch.tensor([2.0 * rank])
    rt.wait(dist.all_reduce(y, async_op=True), "all_reduce", where="a started work")
    out["started"] = y.item()
    out["summed"] = rt.all_reduce_sum(torch.tensor([1.0]), where="a count")[0].item()

    if rank == 0:  # enters nothing below; stays up (it hosts the store)
        rt.store.wait(["test/done"], timedelta(seconds=60))
        return out
    start = time.monotonic()
    out["absent"] = _caught(lambda: rt.all_reduce_sum(torch.ones(1), where="rank 0 is away"))
    out["seconds"] = time.monotonic() - start
    rt.store.set("test/done", "1")
    return out


@pytest.mark.slow
def test_runtime_collectives_are_waited_on_their_own_future() -> None:
    first, second = (r.value for r in run_ranks(_waits_job, 2, timeout=120))
    for values in (first, second):
        assert values["own future"]
        assert values["order"] == ["group operation", "runtime collective"]
        assert values["sum"] == 3.0
        assert values["started"] == 2.0
        assert values["summed"] == 2.0
    kind, text = second["absent"]
    assert kind == "CollectiveTimeoutError", text
    assert (
        "all_reduce at rank 0 is away timed out after 3s waiting for rank(s) 0 "
        "(not entered the operation" in text
    )
    assert second["seconds"] < 30  # the group's timeout (3 s), loosely
