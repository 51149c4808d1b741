"""``fit`` in a surviving job (``gradhub run --survive``): the same global batch again.

- A step is a global batch (``accumulate`` of them), whose indices depend on
  the seed, the epoch and the step only (:meth:`Source.global_batches`); each
  rank trains its share at the current world size, weighted by its samples.
  The next step to train is the number of steps committed so far
  (:attr:`gradhub.Runtime.committed_steps`): after a failed step it has not
  moved, so the same global batch is trained again, split over the
  survivors; a rank that took the step from a peer (it was behind) moves on.
- The epoch's sums (loss, accuracy, the evaluation) are summed again over the
  survivors if a death interrupts them.
- Survival needs data whose global batches any world size can split:
  tensors or a map-style dataset. A ``DataLoader`` (re-sharded per world
  size) or an ``IterableDataset`` is refused at the start.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from gradhub.errors import UnsupportedOptionError
from gradhub.train.data import Source, Step
from gradhub.train.strategies.survival import PEER_FAILURES

if TYPE_CHECKING:
    from gradhub.runtime import Runtime
    from gradhub.runtime.membership import Regrouped


def check_survivable(train: Source, evals: Source | None, per_epoch: int | None) -> None:
    """Refuse data a surviving job cannot split again after a death."""
    for what, source in (("train", train), ("eval_data", evals)):
        if source is not None and not source.indexed:
            raise UnsupportedOptionError(
                f"fit's {what} is a DataLoader or an IterableDataset under `gradhub run "
                "--survive`: its batches depend on the number of workers, so a failed step "
                "could not be trained again on the same global batch\n- help: pass the "
                "tensors or the map-style Dataset (with batch_size=, the global batch size)"
            )
    assert per_epoch is not None  # indexed data has a length


def surviving_steps(
    rt: Runtime, source: Source, epoch: int, per_epoch: int, accumulate: int
) -> Iterator[list[Step]]:
    """The micro-steps of ``epoch`` from the first one not committed yet; a step
    that failed is yielded again (see the module docstring)."""
    chunks = source.global_batches(epoch)
    first = epoch * per_epoch  # steps committed before this epoch
    while (position := rt.committed_steps - first) < per_epoch:
        source.rank, source.world = rt.rank, rt.world_size
        at = position * accumulate
        yield [source.share(c) for c in chunks[at : at + accumulate]]


def surviving_sum(rt: Runtime, values: torch.Tensor, where: str) -> torch.Tensor:
    """``values`` summed over the ranks; summed again over the survivors if a
    peer dies meanwhile (a survivor then brings its own values again)."""
    while True:
        out = values.clone()
        try:
            return rt.all_reduce_sum(out, where=where)
        except PEER_FAILURES as exc:
            rt.regroup(exc)  # raises exc itself without survival


def membership_record(done: Regrouped) -> dict[str, Any]:
    """The metrics record of a regroup (``gradhub plot`` marks it on the curves)."""
    return {
        "generation": done.generation,
        "members": done.members,
        "dead": done.dead,
        "world_size": len(done.members),
        "step": done.committed_steps,
        "time": time.time(),
    }


def member_of(rt: Runtime) -> int:
    """Whose metrics file this rank writes: its member id in a surviving job
    (ranks change as workers die and join), else its rank."""
    return rt.membership.member if rt.membership is not None else rt.rank
