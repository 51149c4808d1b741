"""``diloco`` in a surviving job (``gradhub run --survive``): a dead worker drops
out of the next average, and nothing else changes.

Inner steps communicate nothing, so a worker's death is seen at the next
sync's exchange: the one the dead worker never joins (it died between
syncs) or the one it died in. The sync's step was applied on every survivor
(its inner step is local) and stays committed: ``fit`` does not train it
again, and :attr:`Resync.failed_syncs` counts it (not ``failed_steps``).

- **What is kept.** At each sync a survivor keeps a copy of what it sends:
  its weighted pseudo-gradient and its weight, until the sync is merged.
- **A failure.** A peer failure in the sync (:data:`.survival.PEER_FAILURES`)
  goes through :meth:`Survival._failed` (raised without survival), then the
  runtime regroups (:meth:`gradhub.Runtime.regroup`: the group rebuilt over
  the survivors, the most committed steps agreed) and the survivors settle,
  on the new group (:meth:`Resync._settle`):

  1. every survivor says whether its state is *clean* (no sync under way, or
     its sync's outer step already applied: the exchange completed there
     before the death, with every worker's pseudo-gradient in it) and which
     fragment its sync is of;
  2. if a survivor at the most committed steps is clean, the lowest such
     sends its model and its strategy's state (the inner optimizer, the
     shared weights, the outer optimizer) to the survivors behind it or
     still in that sync (:meth:`Survival._heal`); nothing is redone;
  3. else the survivors behind take the state of the lowest survivor at the
     most committed steps, and the sync is redone over the survivors: each
     survivor that trained the interval sends its kept pseudo-gradient with
     its weight, one that took another's state sends zeros with weight 0,
     so the average is ``sum(N_i d_i) / sum(N_i)`` over the survivors (the
     plain mean over them without ``set_samples``); the outer step and what
     follows are those of any sync, the same bits on every survivor. The
     backward-count check is skipped in a redo.

  A death during the settling regroups again (the runtime's loop) and
  settles again from what each survivor then holds.
- **A replacement** (``--max-restarts``): a rank whose membership watcher
  saw a newer generation says so in the sync's tally; after that sync every
  rank regroups, and the replacement takes the lowest rank's state.
- Refused under survival (at ``prepare``, saying why): ``overlap`` (an
  exchange merged behind inner steps would be redone against progress made
  since) and ``servers`` (the servers' sync rounds are not regrouped for
  diloco's pushes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from gradhub import codecs
from gradhub.errors import UnsupportedByStrategyError
from gradhub.train.strategies.diloco import exchange
from gradhub.train.strategies.diloco.config import DiLoCoConfig
from gradhub.train.strategies.survival import Survival

if TYPE_CHECKING:
    from gradhub.runtime.membership import Regrouped


@dataclasses.dataclass
class Kept:
    """What a survivor sent at its sync: the fragment, its weighted
    pseudo-gradient (a copy) and its weight."""

    fragment: int
    flat: torch.Tensor
    weight: float


class Resync(Survival):
    """The survival part of :class:`~.strategy.DiLoCoStrategy` (see the module docstring)."""

    failed_syncs = 0
    """Syncs a peer's death interrupted (each redone or taken over the survivors)."""

    _kept: Kept | None = None
    _applied = False  # the outer step of the kept sync is applied here
    config: DiLoCoConfig
    codec: codecs.Codec
    _flat: torch.Tensor
    _tally: exchange.Tally
    _pending: exchange.Pending | None
    _span: Callable[[int], tuple[int, int]]
    _merge: Callable[[], None]

    def _refuse_under_survival(self) -> None:
        if not self.runtime.survive:
            return
        if self.config.overlap:
            raise UnsupportedByStrategyError(
                "strategy 'diloco' with overlap= under `gradhub run --survive`: an exchange "
                "merged behind inner steps could not be redone over the survivors\n- help: "
                "overlap=0, or drop --survive"
            )
        if self.config.servers is not None:
            raise UnsupportedByStrategyError(
                "strategy 'diloco' with servers= under `gradhub run --survive`: its pushes "
                "to the servers' sync rounds are not regrouped over the survivors\n- help: "
                "drop servers= (the survivors then redo a sync among themselves) or --survive"
            )

    def _sees_joining(self) -> float:
        """1.0 where this rank saw a newer membership (a replacement is ready)."""
        return 1.0 if self.runtime.survive and self._joining() else 0.0

    def _keep(self, fragment: int, flat: torch.Tensor, weight: float) -> None:
        """Under survival: keep what this rank sends at its sync, until merged."""
        if self.runtime.survive:
            self._kept = Kept(fragment, flat.detach().clone(), weight)
            self._applied = False

    def _sync_failed(self, exc: BaseException) -> None:
        """A peer failure in a sync: raised without survival; else regroup (the
        sync is settled over the survivors from :meth:`_regrouped`)."""
        self._failed(exc)
        cause, self._failure = self._failure, None
        self._regroup_after = False  # this regroup takes in whoever asked for one
        self.failed_syncs += 1
        self.runtime.regroup(cause)

    def _rebind(self) -> None:
        """Fresh exchange buffers: an operation of the old group may still write to
        the old ones. The exchange reads ``runtime.group`` at each sync."""
        self._flat = torch.zeros_like(self._flat)
        self._tally = exchange.Tally(self.runtime.group.device)

    def _regrouped(self, done: Regrouped) -> None:
        self._rebind()
        self._settle(done)

    def _set_up_joined(self) -> None:
        """A replacement at set-up settles with the survivors (it is behind them)."""
        done = self.runtime.joined
        if done is not None:
            self.runtime.joined = None
            self._settle(done)

    def _settle(self, done: Regrouped) -> None:
        """After a regroup: the survivors agree on one state (the module docstring)."""
        rt = self.runtime
        kept = self._kept
        behind = rt.rank in done.behind
        clean = not behind and (kept is None or self._applied)
        fragment = -1 if behind or kept is None else kept.fragment
        rows = rt.group.all_gather_ints([int(clean), fragment], "regroup: diloco's sync")
        ahead = [r for r in range(rt.world_size) if r not in done.behind]
        applied = [r for r in ahead if rows[r][0]]
        source = applied[0] if applied else done.source
        takers = list(done.behind)
        if applied:
            takers += [r for r in ahead if not rows[r][0]]
        if takers:
            self._heal(dataclasses.replace(done, source=source, behind=sorted(takers)))
        if rt.rank in takers:
            kept = None
        redo = rows[source][1]
        if not applied and redo >= 0:
            self._redo(redo, kept)
        self._kept, self._applied = None, False

    def _redo(self, fragment: int, kept: Kept | None) -> None:
        """Fragment ``fragment``'s sync again, over the survivors: ``kept`` (zeros
        with weight 0 where ``None``), then the merge of any sync."""
        lo, hi = self._span(fragment)
        flat = self._flat[lo:hi]
        weight = 0.0
        with torch.no_grad():
            if kept is None:
                flat.zero_()
            else:
                flat.copy_(kept.flat)
                weight = kept.weight
        self._tally.write([weight, 0.0, 0.0, 0.0])
        job = exchange.start(flat, self._tally.tensor, self.codec, self.runtime.group)
        self._pending = exchange.Pending(fragment, job, None, 0)
        self._merge()


__all__ = ["Kept", "Resync"]
