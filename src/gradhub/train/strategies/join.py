"""``with model.join():``: uneven inputs across ranks, as DDP's ``join()``.

Every rank runs its own loop over its own data inside the context. A rank
whose data ran out leaves its loop and, in ``__exit__``, *shadows* the
collectives of the ranks still training until every rank has left:

- While joined, every forward of an active rank (inside the context) makes
  one small all-reduce of ``world_size + 2`` numbers: which ranks are still
  active, whether this forward is followed by a synchronising backward
  (grad enabled and sync on), and whether it broadcasts buffers. A joined
  rank answers with zeros, then takes part in the buffer broadcast and in
  the gradient reduction of that step, contributing zero gradients with
  weight 0 and no "used" flags; its parameters, gradients and optimizer are
  not touched (DDP's ``_match_all_reduce_for_bwd_pass``).
- ``divide_by_initial_world_size=True`` (DDP's default): the active ranks'
  gradients are divided by the initial world size, so a joined rank counts
  as a zero gradient; ``False``: by the number of active ranks.
- Inside the context buffers are broadcast from the highest active rank
  (rank 0 may have joined with stale buffers), as DDP does.
- When every rank has left, the parameters (and buffers where they are
  broadcast at forward) of the last rank to leave (the highest one on a
  tie) are broadcast to every rank, as DDP's ``_sync_final_model``.
  Optimizer states are not synchronised (neither are DDP's).
- ``throw_on_early_termination=True``: once a rank has run out, every rank
  raises :class:`~gradhub.errors.WorkerFailedError` naming the ranks that ran
  out, at its next forward or in ``__exit__``.
- One forward with grad enabled per synchronising backward inside the
  context (DDP's assumption too): two forwards before one backward would
  make a joined rank shadow two steps.

Without ``join()`` a rank that stops stepping leaves the others waiting in
their next collective, which raises
:class:`~gradhub.errors.CollectiveTimeoutError` (or
:class:`~gradhub.errors.WorkerFailedError` if the process ended) naming that
rank within the runtime's timeout.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist

from gradhub.errors import WorkerFailedError
from gradhub.runtime import Runtime
from gradhub.train.ddp_options import DDPOptions


class Joinable(Protocol):
    """What :class:`Join` needs of a strategy (a :class:`Strategy` with ``supports_join``)."""

    model: torch.nn.Module | None
    ddp: DDPOptions
    _join: Any

    @property
    def runtime(self) -> Runtime: ...

    @property
    def world_size(self) -> int: ...

    def _buffers(self) -> list[torch.Tensor]: ...

    def _broadcast(self, tensors: list[torch.Tensor], src: int) -> None: ...

    def _shadow_sync(self) -> None: ...


class Join:
    """The context manager ``model.join()`` returns (see the module docstring)."""

    def __init__(
        self,
        strategy: Joinable,
        *,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> None:
        self.strategy = strategy
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.enable = enable
        self.throw_on_early_termination = throw_on_early_termination
        self.divisor = strategy.world_size
        """What the active ranks divide the summed gradient by this step."""

    def __enter__(self) -> Join:
        if self.enable:
            self.strategy._join = self
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if not self.enable:
            return
        try:
            if exc_type is None:
                self._shadow_until_all_joined()
        finally:
            self.strategy._join = None

    def _exchange(self, active: bool, sync: bool, buffers: bool) -> list[int]:
        """One all-reduce; returns the active ranks and sets :attr:`flags`."""
        world = self.strategy.world_size
        t = torch.zeros(world + 2, dtype=torch.float64)
        if active:
            t[self.strategy.runtime.rank] = 1.0
            t[world], t[world + 1] = float(sync), float(buffers)
        self.strategy.runtime.all_reduce_sum(t, where="join: which ranks are active")
        self.flags = (bool(t[world] > 0), bool(t[world + 1] > 0))
        ranks = [r for r in range(world) if t[r] > 0]
        if self.throw_on_early_termination and len(ranks) < world:
            out = [r for r in range(world) if r not in ranks]
            raise WorkerFailedError(
                f"rank(s) {', '.join(map(str, out))} ran out of inputs inside "
                "join(throw_on_early_termination=True)\n- help: join() without "
                "throw_on_early_termination lets the others go on"
            )
        self.divisor = world if self.divide_by_initial_world_size else max(len(ranks), 1)
        return ranks

    def notify(self, sync: bool, buffers: bool) -> int:
        """An active rank's forward; returns the rank to take buffers from."""
        return max(self._exchange(True, sync, buffers))

    def _shadow_until_all_joined(self) -> None:
        strategy, is_last = self.strategy, True
        while ranks := self._exchange(False, False, False):
            is_last = False
            sync, buffers = self.flags
            if buffers:
                strategy._broadcast(strategy._buffers(), max(ranks))
            if sync:
                strategy._shadow_sync()
        rank = strategy.runtime.rank
        src = torch.tensor([rank if is_last else -1], dtype=torch.int64)
        if strategy.world_size > 1:
            rt, where = strategy.runtime, "join: the last rank to leave"
            largest = rt.collective(
                "all_reduce",
                lambda: dist.all_reduce(src, op=dist.ReduceOp.MAX, async_op=True),
                where=where,
            )
            rt.wait(largest)
        assert strategy.model is not None
        final = [p.data for p in strategy.model.parameters()]
        if strategy.ddp.sync_buffers_at_forward:
            final += strategy._buffers()
        strategy._broadcast(final, int(src[0]))
