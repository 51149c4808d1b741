"""The ``ps-*`` strategies in a surviving job (``gradhub run -n N --survive --servers S``).

The servers are not workers: a worker's death leaves them running, and they
hold the parameters and the optimizer state, so the survivors take nothing
from each other after a regroup: they tell the servers the new membership
(:meth:`~gradhub.ps.client.remote.RemoteParameterServer.set_members`, from the
new rank 0) and pull what the servers hold. Worker ids on the servers are the
members' ids (the ranks of generation 0), which a regroup does not change.

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
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from concurrent.futures import Future

from gradhub.errors import WorkerFailedError
from gradhub.runtime.membership import Membership

WATCH_SLICE = 0.05
"""Seconds between two looks at the membership while waiting for the servers."""


def settle(
    futures: Sequence[Future[None]], timeout: float, membership: Membership | None, where: str
) -> None:
    """Wait for each of ``futures`` (at most ``timeout`` seconds each). With a
    ``membership`` (a surviving job), a newer generation meanwhile (a worker
    died, or a replacement is ready) fails the wait: :class:`WorkerFailedError`,
    and the step is trained again over the new membership."""
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
                if membership.pending:
                    raise WorkerFailedError(
                        f"{where}: the job's membership changed (generation "
                        f"{membership.generation + 1} is out) while waiting for the servers"
                    ) from None
                if time.monotonic() >= deadline:
                    raise
