"""A step that a peer's death interrupts, in a surviving job (``gradhub run --survive``).

The strategy side of survival (the runtime side, the membership and the
group rebuilt over the survivors: :mod:`gradhub.runtime.membership`):

- **Nothing raises in the user's loop.** A peer's death seen during the
  backward's communication (:class:`~gradhub.errors.WorkerFailedError`, or a
  :class:`~gradhub.errors.CollectiveTimeoutError`) is recorded and the rest
  of that step's communication is skipped: ``loss.backward()`` returns
  normally. Without survival the error is raised, as before.
- **A failed step commits nowhere.** ``optimizer.step()`` of a failed step
  updates nothing and returns normally: it regroups (the runtime waits for
  the next membership and sets the group up over the survivors), the
  strategy rebinds its communication to the new group (:meth:`_rebind`),
  and the step's gradients are dropped. The loop then trains the same
  global batch again, split over the survivors (``fit``, or
  :class:`gradhub.GlobalBatchSampler` in an own loop).
- **Every survivor continues from the same state.** A peer may die while the
  last step's results are still reaching some ranks: those that got them
  all applied the step, the others did not. After a regroup the survivors
  agree on the most steps any of them applied; the lowest rank that
  applied them sends its parameters, buffers and optimizer state to the
  ranks behind (a broadcast over the new group), so the replicas stay
  bit-identical and no applied step is trained twice.
- A strategy survives where it says so (:attr:`survives`) and provides
  :attr:`_rebind` (or a :meth:`_regrouped` of its own); the others refuse
  ``--survive`` at ``prepare`` with
  :class:`~gradhub.errors.UnsupportedByStrategyError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from gradhub.errors import CollectiveTimeoutError, UnsupportedByStrategyError, WorkerFailedError
from gradhub.train.strategies.part import StrategyPart

if TYPE_CHECKING:
    from gradhub.runtime import Runtime
    from gradhub.runtime.membership import Regrouped

PEER_FAILURES = (WorkerFailedError, CollectiveTimeoutError)
"""What a peer's death (or silence) raises in a step's communication."""

_STALE = WorkerFailedError("the step trains a share a regroup made stale (never raised)")
"""Marks a step whose batch a regroup made stale: it sends and applies nothing."""


class Survival(StrategyPart):
    """The survival part of :class:`~gradhub.train.strategies.base.Strategy`.

    What it needs of the strategy, besides the runtime (:class:`.StrategyPart`):
    the attributes annotated below; :attr:`_rebind` only where it
    :attr:`survives` and keeps this :meth:`_regrouped`, which calls it.
    """

    survives: ClassVar[bool] = False
    """Whether the strategy keeps training over the survivors of a peer's death."""

    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    _synced: bool
    _samples: tuple[int, int | None] | None
    set_samples: Callable[[int, int | None], None]
    state_dict: Callable[[], dict[str, Any]]
    load_state_dict: Callable[[dict[str, Any]], None]
    _rebind: Callable[[], None]
    """Point the strategy's communication at ``self.runtime.group`` (new after a regroup)."""

    failed_steps = 0
    """Steps a peer's death interrupted (each trained again over the survivors)."""

    stale_steps = 0
    """Steps trained on a share a regroup made stale (a prefetching loader's), never applied."""

    _failure: BaseException | None = None
    """What interrupted the current step (a peer's death), or :data:`_STALE`."""
    _stale = False  # the current step trains a stale share (a prefetching loader's)
    _regroup_after = False  # a rank asked to regroup after this step (a replacement)

    def _join_survival(self, runtime: Runtime) -> None:
        """At set-up: refuse a job that survives unless this strategy does."""
        if not runtime.survive:
            return
        if not self.survives:
            raise UnsupportedByStrategyError(
                f"strategy {self.name!r} does not survive a worker's death yet: its state "
                "lives partly on each worker\n- help: use strategy='allreduce' under "
                "`gradhub run --survive`, or drop --survive"
            )
        runtime.on_regroup(self._regrouped)

    def _joining(self) -> bool:
        """Whether this rank asks the others to regroup after this step: a newer
        membership (a replacement ready to join) is in the store."""
        membership = self.runtime.membership
        return membership is not None and membership.pending

    def _after_step(self) -> None:
        """A committed step ended: regroup here if some rank asked for it (every
        rank got the same answer with the step's flags)."""
        if self._regroup_after:
            self._regroup_after = False
            self.runtime.regroup(None)

    def _set_up_joined(self) -> None:
        """At set-up of a replacement: take the survivors' state, as each survivor's
        :meth:`_regrouped` sends it (instead of rank 0's initial parameters)."""
        done = self.runtime.joined
        if done is not None:
            self.runtime.joined = None
            self._heal(done)

    def _failed(self, exc: BaseException) -> None:
        """A peer failure during the step's communication: raised without survival,
        else recorded (the step is then trained again)."""
        if not self.runtime.survive:
            raise exc
        self._failure = exc

    def _take_share(self) -> None:
        """A synchronising backward starts: take the share of a global batch it
        trains, if a :class:`gradhub.GlobalBatchSampler` handed one out. Its
        samples weight this rank (unless the loop called ``set_samples``); one
        made stale by a regroup (or trained by a peer already) is trained
        locally only: nothing is sent, and the step applies nothing."""
        rt = self.runtime
        if not rt.batches:
            return
        share = rt.batches.popleft()
        if rt.survive and not share.current(rt.generation, rt.committed_steps):
            self._failure, self._stale = _STALE, True
            return
        if self._samples is None and getattr(self, "_hook", None) is None:
            self.set_samples(share.samples, share.global_samples)

    def _recover(self) -> None:
        """``optimizer.step()`` of a failed step: regroup, drop the step's gradients."""
        exc, self._failure = self._failure, None
        self._synced, self._samples = False, None
        if self._stale:
            self._stale, exc = False, None
            self.stale_steps += 1
        else:
            self.failed_steps += 1
        if self.model is not None:
            for p in self.model.parameters():
                p.grad = None
        if exc is not None:
            self.runtime.regroup(exc)

    def _regrouped(self, done: Regrouped) -> None:
        """After the runtime's regroup: communication on the new group, then the
        ranks behind take the furthest state (see the module docstring)."""
        self._rebind()
        if done.behind:
            self._heal(done)

    def _heal(self, done: Regrouped) -> None:
        assert self.model is not None
        rank = self.runtime.rank
        payload: list[Any] = [None]
        if rank == done.source:
            payload[0] = {"model": self.model.state_dict(), "strategy": self.state_dict()}
        dist.broadcast_object_list(payload, src=done.source)
        if rank in done.behind:
            self.model.load_state_dict(payload[0]["model"])
            self.load_state_dict(payload[0]["strategy"])
            self.runtime.committed_steps = done.committed_steps
