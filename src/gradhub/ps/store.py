"""ParameterStore: the key -> (value, optimizer) table behind a parameter server.

A plain, single-threaded object: no queue, no thread, no lock. The local and
the remote servers wrap it with their own concurrency; callers serialise access.

Decisions:

- ``init`` stores a detached copy of the value; its shape and dtype are fixed.
- ``optimizer`` is a factory ``list[Tensor] -> torch.optim.Optimizer`` called
  once per key with ``[value]``, so optimizer state (momentum, Adam moments)
  lives with its key. ``None`` follows MXNet's KVStore without an updater: a
  push *replaces* the value with the pushed sum, so the store aggregates
  (push gradients, pull their sum) instead of training.
- ``apply(key, grad)`` runs exactly one optimizer step: the value's ``.grad``
  is set to ``grad``, ``step()`` runs, ``.grad`` is cleared again.
- ``state_dict()`` holds copies of the values and of each optimizer's state;
  ``load_state_dict()`` checks everything before changing anything.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from gradhub.errors import DuplicateParameterError, UnknownParameterError
from gradhub.ps.base import check_like

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class ParameterStore:
    """Values and per-key optimizers, with one-step-per-push apply."""

    def __init__(self, optimizer: OptimizerFactory | None = None) -> None:
        self._factory = optimizer
        self._values: dict[str, torch.Tensor] = {}
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._steps: dict[str, int] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._values))

    def keys(self) -> Iterator[str]:
        return iter(self)

    def value(self, key: str) -> torch.Tensor:
        """The stored tensor itself (not a copy); ``UnknownParameterError`` if absent."""
        try:
            return self._values[key]
        except KeyError:
            raise UnknownParameterError(
                f"unknown parameter key {key!r}; call init({key!r}, ...) first"
            ) from None

    def steps(self, key: str) -> int:
        """How many pushes have been applied to ``key``."""
        self.value(key)
        return self._steps[key]

    def optimizer(self, key: str) -> torch.optim.Optimizer | None:
        self.value(key)
        return self._optimizers.get(key)

    def check(self, key: str, tensor: torch.Tensor) -> None:
        """Raise if ``key`` is unknown or ``tensor`` differs from it in shape or dtype."""
        check_like(key, self.value(key), tensor)

    def init(self, key: str, value: torch.Tensor) -> None:
        """Store a copy of ``value`` under ``key``; ``DuplicateParameterError`` if present."""
        if not isinstance(key, str) or not key:
            raise TypeError(f"parameter keys are non-empty strings, got {key!r}")
        if key in self._values:
            raise DuplicateParameterError(
                f"parameter {key!r} is already initialised; each key is initialised once"
            )
        stored = value.detach().clone()
        optimizer = self._factory([stored]) if self._factory is not None else None
        self._values[key] = stored
        self._steps[key] = 0
        if optimizer is not None:
            self._optimizers[key] = optimizer

    def apply(self, key: str, grad: torch.Tensor) -> None:
        """One update of ``key`` with ``grad`` (already summed over replicas)."""
        value = self.value(key)
        optimizer = self._optimizers.get(key)
        with torch.no_grad():
            if optimizer is None:
                value.copy_(grad)
            else:
                value.grad = grad.to(device=value.device, dtype=value.dtype)
                try:
                    optimizer.step()
                finally:
                    value.grad = None
        self._steps[key] += 1

    def copy_into(self, key: str, targets: Sequence[torch.Tensor]) -> None:
        """Copy the value of ``key`` into every tensor of ``targets`` in place."""
        value = self.value(key)
        with torch.no_grad():
            for t in targets:
                t.copy_(value)

    def state_dict(self) -> dict[str, Any]:
        """Copies of every value, optimizer state and step count."""
        return {
            "values": {k: v.detach().clone() for k, v in self._values.items()},
            "optimizers": {k: copy.deepcopy(o.state_dict()) for k, o in self._optimizers.items()},
            "steps": dict(self._steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore values and optimizer state saved by :meth:`state_dict`.

        Keys not yet present are initialised; present keys must match in shape
        and dtype. Everything is checked before anything changes.
        """
        values: dict[str, torch.Tensor] = state["values"]
        optimizers: dict[str, Any] = state.get("optimizers", {})
        for key, v in values.items():
            if key in self._values:
                check_like(key, self._values[key], v)
        for key in optimizers:
            if key not in values:
                raise ValueError(f"optimizer state for {key!r} has no value in the checkpoint")
        if optimizers and self._factory is None:
            raise ValueError("the checkpoint holds optimizer state but this store has none")
        for key, v in values.items():
            if key in self._values:
                with torch.no_grad():
                    self._values[key].copy_(v)
            else:
                self.init(key, v)
            if key in optimizers:
                self._optimizers[key].load_state_dict(copy.deepcopy(optimizers[key]))
            self._steps[key] = int(state.get("steps", {}).get(key, 0))
