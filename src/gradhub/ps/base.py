"""The parameter-server interface shared by the local and remote stores.

Semantics follow MXNet's KVStore, which DJL's ``ParameterServer`` wraps:

- ``init(key, values, *, optimizer=None)``: one value per key, given as a
  list of replicas (one per device) that must all have the same shape and
  dtype; the first replica is stored. A second ``init`` of a key is a
  ``DuplicateParameterError``. ``optimizer`` is an
  :class:`~gradhub.optim.OptimizerSpec` with one group, the hyperparameters
  for this key: the key's server-side optimizer is built from it. A server
  fixed to an optimizer of its own (``gradhub serve --optimizer adam --lr
  1e-3``, or ``LocalParameterServer(optimizer=...)``) refuses a different spec
  with ``OptimizerMismatchError`` naming both; a server without one takes the
  spec. Every slice of a sliced tensor gets the same spec.
- ``push(key, grads, *, priority=0, hyperparameters=None)``: the replicas are
  summed and the key's server-side optimizer runs *once* on the sum. The
  ``hyperparameters`` (e.g. ``{"lr": 0.05}`` from the worker's LR scheduler)
  are set on the key's param group first, as part of the same push (applied
  exactly once with it). Returns a future that is done when the server has
  taken the push.
- ``pull(key, weights, *, priority=0)``: the stored value is copied into every
  tensor of ``weights`` (in place). Returns a future done when they are filled.
- Per key, one client's operations keep their order: a pull sees that
  client's earlier pushes applied. Among queued operations, the higher
  ``priority`` runs first; equal priorities run first in, first out.
- ``optimizer_state(key, like)`` / ``set_optimizer_state(key, state, like)``:
  read or replace the state of the key's server-side optimizer, in the format
  ``torch.optim`` keeps for one parameter (Adam: ``step``, ``exp_avg``,
  ``exp_avg_sq``, tensors shaped like the value), so a server's state and a
  single-process optimizer's state are interchangeable. ``like`` is a tensor
  of the key's shape and dtype (it fixes the layout of a sliced key, as the
  weights of a ``pull`` do). Both run after this client's operations queued
  before them on the key and block until done.
- ``close()``: idempotent; any later call raises ``ClosedError``.

A single tensor is accepted wherever a list of replicas is, and NumPy arrays
are converted.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any

import numpy as np
import torch

from gradhub.errors import (
    DtypeMismatchError,
    InvalidOptionError,
    ShapeMismatchError,
    WrongTypeError,
)
from gradhub.optim import OptimizerSpec
from gradhub.trees import ROOT

Replicas = torch.Tensor | np.ndarray | Sequence[torch.Tensor | np.ndarray]


def check_key(key: object) -> str:
    """``key`` if it is a ``str``, else a :class:`~gradhub.errors.WrongTypeError` naming it."""
    if not isinstance(key, str):
        raise WrongTypeError(
            f"parameter keys are str, got {key!r} of type {type(key).__name__}; "
            f"use e.g. {str(key)!r}"
        )
    return key


def as_replicas(values: Replicas, *, what: str = "values") -> list[torch.Tensor]:
    """Normalise one tensor/array or a sequence of them to a non-empty list of
    tensors of one shape and dtype (``ShapeMismatchError`` names the replica).

    A dict (a tree of named tensors) is not one value: each tensor goes under
    its own key (``for name, p in model.named_parameters(): ps.init(name, p)``)."""
    if isinstance(values, Mapping):
        raise WrongTypeError(
            f"{what} is a dict; a parameter-server key holds one tensor (or a list of "
            "replicas of one tensor)\n- help: use one key per tensor, e.g. "
            "`for name, p in model.named_parameters(): ps.init(name, p)`"
        )
    if isinstance(values, (torch.Tensor, np.ndarray)):
        values = [values]
    out: list[torch.Tensor] = []
    for i, v in enumerate(values):
        if isinstance(v, np.ndarray):
            v = torch.from_numpy(np.ascontiguousarray(v))
        if not isinstance(v, torch.Tensor):
            raise WrongTypeError(
                f"{what}[{i}] must be a tensor or NumPy array, got {type(v).__name__}"
            )
        out.append(v)
    if not out:
        raise InvalidOptionError(f"{what} must hold at least one tensor")
    first = out[0]
    for i, v in enumerate(out[1:], start=1):
        if v.shape != first.shape:
            raise ShapeMismatchError(f"{what}[{i}]", list(first.shape), list(v.shape))
        if v.dtype != first.dtype:
            raise DtypeMismatchError(f"{what}[{i}]", first.dtype, v.dtype)
    return out


def check_like(key: str, stored: torch.Tensor, given: torch.Tensor) -> None:
    """Raise ``ShapeMismatchError`` naming ``key`` if shape or dtype differ."""
    if given.shape != stored.shape:
        path = f"[{key!r}]" if key else ROOT
        raise ShapeMismatchError(path, list(stored.shape), list(given.shape))
    if given.dtype != stored.dtype:
        path = f"[{key!r}]" if key else ROOT
        raise DtypeMismatchError(path, stored.dtype, given.dtype)


class ParameterServer(abc.ABC):
    """A key-value store of parameters, with gradients applied server-side."""

    @abc.abstractmethod
    def init(self, key: str, values: Replicas, *, optimizer: OptimizerSpec | None = None) -> None:
        """Store the initial value of ``key`` (replicas must agree in shape and dtype)."""

    @abc.abstractmethod
    def push(
        self,
        key: str,
        grads: Replicas,
        *,
        priority: int = 0,
        hyperparameters: Mapping[str, Any] | None = None,
    ) -> Future[None]:
        """Sum ``grads`` and apply one optimizer update to ``key``."""

    @abc.abstractmethod
    def pull(self, key: str, weights: Replicas, *, priority: int = 0) -> Future[None]:
        """Copy the value of ``key`` into every tensor of ``weights``."""

    @abc.abstractmethod
    def optimizer_state(self, key: str, like: torch.Tensor) -> dict[str, Any]:
        """A copy of the state of ``key``'s server-side optimizer (``{}`` before its first step)."""

    @abc.abstractmethod
    def set_optimizer_state(self, key: str, state: Mapping[str, Any], like: torch.Tensor) -> None:
        """Replace the state of ``key``'s server-side optimizer by ``state``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release threads and sockets; idempotent."""

    def empty_like(self, like: torch.Tensor) -> torch.Tensor:
        """A new contiguous CPU tensor of ``like``'s shape and dtype (uninitialised)
        that :meth:`push` and :meth:`pull` move with the fewest copies.

        A :class:`~gradhub.RemoteParameterServer` places it in its shared-memory
        arena (:mod:`gradhub.ps.client.shared_tensors`): a server on this host reads a push
        of it, and writes a pull into it, where it lies, with no copy in the
        client. Elsewhere it is an ordinary tensor. Either way it is yours: use
        it as any tensor; the rule of every asynchronous call holds, only more
        strictly: a push reads it, a pull writes it, until its future is done.
        A push of it is checked for NaN and infinity by the server alone (one
        read of it, not two): with ``nonfinite="error"`` a refusal is the
        future's ``NonFiniteError`` (nothing applied), not raised at the call.
        """
        return torch.empty(like.shape, dtype=like.dtype)

    def shared_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """:meth:`empty_like` holding a copy of ``tensor``'s values (e.g. a model's
        parameters: ``p.data = ps.shared_like(p.data)``, then pull into ``p.data``)."""
        out = self.empty_like(tensor)
        out.copy_(tensor)
        return out

    def in_arena(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lies in memory of :meth:`empty_like` that push and pull
        move without a client copy (contiguous, in one of this client's segments)."""
        return False

    def __enter__(self) -> ParameterServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
