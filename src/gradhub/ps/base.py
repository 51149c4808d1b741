"""The parameter-server interface shared by the local and remote stores.

Semantics follow MXNet's KVStore, which DJL's ``ParameterServer`` wraps:

- ``init(key, values)``: one value per key, given as a list of replicas (one
  per device) that must all have the same shape and dtype; the first replica
  is stored. A second ``init`` of a key is a ``DuplicateParameterError``.
- ``push(key, grads, priority)``: the replicas are summed and the key's
  server-side optimizer runs *once* on the sum. Returns a future that is
  done when the update has been applied.
- ``pull(key, weights, priority)``: the stored value is copied into every
  tensor of ``weights`` (in place). Returns a future done when they are filled.
- Per key, one client's operations keep their order: a pull sees that
  client's earlier pushes applied. Among queued operations, the higher
  ``priority`` runs first; equal priorities run first in, first out.
- ``close()``: idempotent; any later call raises ``ClosedError``.

A single tensor is accepted wherever a list of replicas is, and NumPy arrays
are converted.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from concurrent.futures import Future
from types import TracebackType

import numpy as np
import torch

from gradhub.errors import DtypeMismatchError, ShapeMismatchError
from gradhub.trees import ROOT

Replicas = torch.Tensor | np.ndarray | Sequence[torch.Tensor | np.ndarray]


def as_replicas(values: Replicas, *, what: str = "values") -> list[torch.Tensor]:
    """Normalise one tensor/array or a sequence of them to a non-empty list of
    tensors of one shape and dtype (``ShapeMismatchError`` names the replica)."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        values = [values]
    out: list[torch.Tensor] = []
    for i, v in enumerate(values):
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(np.ascontiguousarray(v))
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{what}[{i}] must be a tensor or NumPy array, got {type(v).__name__}")
        out.append(v)
    if not out:
        raise ValueError(f"{what} must hold at least one tensor")
    first = out[0]
    for i, v in enumerate(out[1:], start=1):
        if v.shape != first.shape:
            raise ShapeMismatchError(f"{what}[{i}]", list(first.shape), list(v.shape))
        if v.dtype != first.dtype:
            raise DtypeMismatchError(f"{what}[{i}]", first.dtype, v.dtype)
    return out


def check_like(key: str, stored: torch.Tensor, given: torch.Tensor) -> None:
    """Raise ``ShapeMismatchError`` naming ``key`` if shape or dtype differ."""
    path = f"[{key!r}]" if key else ROOT
    if given.shape != stored.shape:
        raise ShapeMismatchError(path, list(stored.shape), list(given.shape))
    if given.dtype != stored.dtype:
        raise DtypeMismatchError(path, stored.dtype, given.dtype)


class ParameterServer(abc.ABC):
    """A key-value store of parameters, with gradients applied server-side."""

    @abc.abstractmethod
    def init(self, key: str, values: Replicas) -> None:
        """Store the initial value of ``key`` (replicas must agree in shape and dtype)."""

    @abc.abstractmethod
    def push(self, key: str, grads: Replicas, priority: int = 0) -> Future[None]:
        """Sum ``grads`` and apply one optimizer update to ``key``."""

    @abc.abstractmethod
    def pull(self, key: str, weights: Replicas, priority: int = 0) -> Future[None]:
        """Copy the value of ``key`` into every tensor of ``weights``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release threads and sockets; idempotent."""

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
