"""What the workers of a ``ps-*`` job agree on among themselves (not through
the servers): rank 0's one-off work, and small values it tells the others.

Decisions:
- Every wait is bounded by the runtime's timeout and goes through
  :meth:`~gradhub.runtime.Runtime.wait`, so a rank that does not answer is a
  :class:`~gradhub.errors.CollectiveTimeoutError` (or
  :class:`~gradhub.errors.WorkerFailedError`) naming it, never torch's raw
  error or a hang. That is why there is no ``broadcast_object_list`` here
  (it has no timeout of its own): a value travels as JSON bytes in two
  tensor broadcasts (its length, then the bytes).
- :func:`on_rank0` runs work on rank 0 and returns a small integer from it
  to every rank in the same all-reduce that says whether it failed; a
  failure on rank 0 is re-raised there and a :class:`~gradhub.errors.GradhubError`
  on the other ranks that names rank 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradhub.errors import GradhubError
from gradhub.runtime import Runtime


def on_rank0(runtime: Runtime, work: Callable[[], int], what: str, name: str) -> int:
    """Run ``work`` on rank 0; every rank returns its result once it is done.

    ``what`` says what the work does ("initialise the parameters on the
    servers"), ``name`` is the strategy's, both for the other ranks' error.
    """
    failed: Exception | None = None
    value = 0
    if runtime.is_main:
        try:
            value = int(work())
        except Exception as exc:
            failed = exc
    flag = torch.tensor([1.0 if failed is not None else 0.0, float(value)], dtype=torch.float64)
    runtime.all_reduce_sum(flag, where=f"parameter servers: {what}")
    if failed is not None:
        raise failed
    if flag[0].item() > 0:
        raise GradhubError(
            f"rank 0 could not {what} ({name}); its error says why\n- help: read rank 0's traceback"
        )
    return int(flag[1].item())


def broadcast_json(runtime: Runtime, value: Any, where: str) -> Any:
    """Rank 0's ``value`` (a JSON value) on every rank; a bounded wait."""
    if runtime.world_size == 1:
        return value
    data = json.dumps(value).encode() if runtime.is_main else b""
    size = torch.tensor([len(data)], dtype=torch.int64)
    runtime.wait(
        runtime.collective("broadcast", lambda: dist.broadcast(size, 0, async_op=True), where=where)
    )
    buffer = torch.zeros(int(size.item()), dtype=torch.uint8)
    if runtime.is_main:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    runtime.wait(
        runtime.collective(
            "broadcast", lambda: dist.broadcast(buffer, 0, async_op=True), where=where
        )
    )
    return value if runtime.is_main else json.loads(buffer.numpy().tobytes().decode())
