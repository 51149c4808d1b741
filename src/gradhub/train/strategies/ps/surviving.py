"""The ``ps-*`` strategies in a surviving job (``gradhub run -n N --survive --servers S``).

The servers are not workers: a worker's death leaves them running, and they
hold the parameters and the optimizer state, so the survivors take nothing
from each other after a regroup: they tell the servers the new membership
(:meth:`~gradhub.ps.client.remote.RemoteParameterServer.set_members`, from the
new rank 0) and pull what the servers hold. Worker ids on the servers are the
members' ids (the ranks of generation 0, a replacement's new id), which a
regroup does not change.

``ps-sync``: a step commits on every live worker or on none.

- Each push is tagged with the job's step (its committed steps) and its
  membership generation; the servers apply a key's round of a step once every
  member pushed for it, and each step of a key at most once
  (:mod:`gradhub.ps.server.consistency`).
- A worker sees a death in the gradients' all-reduce, or, while it waits for
  the servers' answers, from the membership (a newer generation is out: the
  dead worker's share of a round will never come). The step then fails: the
  values it pulled stay aside (pulls go into buffers of their own and are
  copied into the parameters once every key came back), so the parameters
  are still those the step started from.
- After the regroup the servers drop the rounds not applied and ignore any
  push of the old generation still on its way, so no round mixes the dead
  worker's push with the redo. The same global batch is trained again, split
  over the survivors and weighted by samples; a key whose round was applied
  before the death keeps that update (the redo's push of it is ignored), the
  others get the redo's: every key gets the global batch's gradient once.
- A survivor that got every answer before it saw the death committed the
  step; one that did not is behind and pulls the servers' values (the
  runtime agrees on the most steps any survivor committed).

``ps-async`` / ``ps-ssp``: each worker pushes its own share of the global
batch; under survival a step commits once every worker's pushes were
accepted (one small all-reduce after them), so a death is seen in the step
it happens in. Every sample's gradient reaches each key once:

- The pushes are tagged as ``ps-sync``'s, and every worker pushes every key
  at every step (a parameter it did not use, or a step its loss scaler
  skipped: a skip push, which applies nothing). A server holds a key's
  pushes of a step until every member's arrived, then applies each on its
  own, in the order of the worker ids (an asynchronous update per push, as
  without survival; the workers wait for each other at every step anyway).
- A worker that dies between two pushes of a step leaves the keys it pushed
  complete (applied once the survivors' pushes arrive: the whole global
  batch, split over the old membership) and the others waiting for it. The
  new membership drops the steps not applied; the survivors train the same
  global batch again, split over themselves: the keys whose step was
  applied ignore the redo's pushes, the others apply them. No share is
  applied twice, none is lost.
- The servers drop the dead worker from ssp's staleness bound when told the
  new membership, so no pull waits for it.

A replacement (``--max-restarts R``) joins at a step boundary: a newer
membership that only takes it in does not fail a wait for the servers (every
member of the step is alive); each rank says it saw one in the step's own
agreement (ps-sync's flags, ps-async/ssp's step-end all-reduce) and every
rank regroups after that step. The replacement has its own member id and the
job's committed steps (from the runtime's agreement with the survivors); it
reads the servers' addresses from the launcher's store, takes part in
telling the servers the new membership (from which they count it: a sync
round of the next step waits for its push, ssp's staleness starts it at the
steps applied) and pulls the servers' values; the model's buffers come from
the survivors (:func:`share_buffers`).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradhub.errors import WorkerFailedError
from gradhub.runtime.membership import Membership, Regrouped, members_key
from gradhub.train.strategies.ps.coordination import on_rank0

if TYPE_CHECKING:
    from gradhub.runtime import Runtime

WATCH_SLICE = 0.05
"""Seconds between two looks at the membership while waiting for the servers."""


def settle(
    futures: Sequence[Future[None]], timeout: float, membership: Membership | None, where: str
) -> None:
    """Wait for each of ``futures`` (at most ``timeout`` seconds each). With a
    ``membership`` (a surviving job), a newer generation meanwhile that a
    worker's death brought fails the wait: :class:`WorkerFailedError`, and the
    step is trained again over the new membership. A newer one that only takes
    a replacement in does not: every member of this step is alive, so the
    step completes, and the ranks regroup after it (at the step boundary)."""
    for future in futures:
        if membership is None or future.done():
            future.result(timeout=timeout)
            continue
        deadline = time.monotonic() + timeout
        while True:
            try:
                future.result(timeout=min(WATCH_SLICE, max(0.0, deadline - time.monotonic())))
                break
            except concurrent.futures.TimeoutError:
                if membership.pending and death_pending(membership):
                    raise WorkerFailedError(
                        f"{where}: the job's membership changed (generation "
                        f"{membership.generation + 1} is out) while waiting for the servers"
                    ) from None
                if time.monotonic() >= deadline:
                    raise


def death_pending(membership: Membership) -> bool:
    """Whether a generation newer than this rank's left a member out (a death);
    ``False`` where the newer ones only take replacements in."""
    number = membership.generation + 1
    while membership.store.check([members_key(number)]):
        if membership.read(number).dead:
            return True
        number += 1
    return False


def tell_members(runtime: Runtime, client: Any, done: Regrouped, name: str) -> None:
    """The new rank 0 tells the servers the membership ``done``; every rank
    waits for it (a replacement too, at its set-up: the servers then count
    its worker id from its first push)."""

    def tell() -> int:
        client.set_members(done.members, done.generation)
        return 0

    on_rank0(runtime, tell, "tell the servers the new membership", name)


def share_buffers(runtime: Runtime, model: torch.nn.Module | None, done: Regrouped) -> None:
    """After a regroup with ranks behind (a replacement among them): every rank
    takes the buffers of the rank that applied the most steps (the parameters
    come from the servers). Every rank of the new group calls it alike."""
    buffers = [] if model is None else list(model.buffers())
    if not done.behind:
        return
    for buffer in buffers:

        def send(tensor: torch.Tensor = buffer) -> object:
            return dist.broadcast(tensor, done.source, async_op=True)

        runtime.wait(runtime.collective("broadcast", send, where="regroup: the model's buffers"))
