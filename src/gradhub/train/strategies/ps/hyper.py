"""The script's hyperparameters, kept current on the servers (``ps-*``).

Decisions:
- Every hyperparameter of a group travels, whatever its type
  (:func:`gradhub.optim.wire_hyperparameters`: numbers, booleans, ``None``,
  strings, tuples such as Adam's ``betas``; a one-element tensor as its
  number), not only the numeric ones: a change to ``betas``,
  ``weight_decay``, ``amsgrad`` or ``maximize`` made mid-run by the user or
  a scheduler reaches the servers as an ``lr`` change does.
- What each key's optimizer on the servers holds is tracked per key, not per
  group: a key that is not pushed in a step (an unused parameter) gets the
  changes it missed with its next push. A change travels with the push it
  precedes and is set on the servers before that push is applied.
- The first push of each key after set-up sends the group's constructor
  hyperparameters whole: servers kept from an earlier attempt (a worker
  restart) may hold the values the previous attempt last sent, and the
  script's groups (restored from its checkpoint) are what counts.
- The keys that travel are those the group had at set-up; a key added to a
  group later (``initial_lr`` of a scheduler made after ``prepare``) stays
  local, since the servers' optimizer has no such hyperparameter.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch

from gradhub.optim import wire_hyperparameters


class HyperparameterTracker:
    """Per key: the hyperparameters its optimizer on the servers holds."""

    def __init__(self, optimizer: torch.optim.Optimizer | None, groups: Sequence[int]) -> None:
        """``groups``: the group index of each key, in key order."""
        self._optimizer = optimizer
        self._groups = list(groups)
        self._known: list[set[str]] = []
        self._held: list[dict[str, Any]] = []  # per key
        self._current: list[dict[str, Any]] = []  # per group, read once per step
        self._accepted: set[str] = set()  # the constructor's hyperparameters
        if optimizer is None:
            return
        accepted = set(inspect.signature(type(optimizer).__init__).parameters)
        self._accepted = accepted
        self._known = [{k for k in g if k != "params"} for g in optimizer.param_groups]
        start = [wire_hyperparameters(g) for g in optimizer.param_groups]
        # The first push sends every constructor hyperparameter; the others
        # (a scheduler's initial_lr) only when they change.
        self._held = [
            {k: _UNSENT if k in accepted else v for k, v in start[g].items()} for g in self._groups
        ]

    def begin_step(self) -> None:
        """Read the groups as they are now (once per step, before the pushes)."""
        if self._optimizer is None:
            return
        self._current = [
            wire_hyperparameters({k: v for k, v in group.items() if k in known})
            for group, known in zip(self._optimizer.param_groups, self._known, strict=True)
        ]

    def for_push(self, index: int) -> dict[str, Any] | None:
        """What key ``index``'s push must carry (``None``: nothing changed); marks it held."""
        if self._optimizer is None:
            return None
        current, held = self._current[self._groups[index]], self._held[index]
        changed = {
            k: v for k, v in current.items() if held.get(k, _UNSENT) is _UNSENT or held[k] != v
        }
        held.update(changed)
        return changed or None

    def reset(self) -> None:
        """The keys changed (a new generation after a model load): all sent afresh."""
        for held in self._held:
            held.update({k: _UNSENT for k in held if k in self._accepted})


class _Unsent:
    def __repr__(self) -> str:
        return "<unsent>"


_UNSENT: Any = _Unsent()
