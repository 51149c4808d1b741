"""LocalParameterServer: an in-process, thread-safe parameter server.

One worker thread runs the queued ``push`` and ``pull`` operations against a
:class:`~gradhub.ps.server.store.ParameterStore`. See :mod:`gradhub.ps.base` for the
interface's semantics.

Decisions:

- **Ordering rule.** One lane per key in :class:`~gradhub.ps.lanes.PriorityLanes`:
  per key, operations run in the order they were submitted, from every client
  (which keeps each client's order, as the interface asks). Priority chooses
  *between keys*, and an urgent operation lifts the operations queued before
  it on its key (priority inheritance). Equal priorities: first in, first out.
- **Errors at call time.** Unknown key, shape or dtype mismatch
  (``DtypeMismatchError``), a push holding NaN or infinity
  (``NonFiniteError``), a second ``init``, a key that is not a ``str``, bad
  arguments and use after ``close()`` raise in the caller's thread; nothing is
  queued. Unlike a remote server, a push or pull of an unknown key does not
  wait for its ``init``: in one process ``init`` is synchronous, so no caller
  can be ahead of it. A failure while an operation runs (e.g. inside
  the optimizer) is set on its future.
- **Push snapshots.** ``push`` sums the replicas in the caller's thread (one
  read of each gradient, one write of the sum), so the caller may reuse its
  gradient buffers as soon as ``push`` returns; the optimizer step runs on
  the worker thread. ``pull`` fills the given tensors when its future is done.
- ``init`` is synchronous and returns once the value is stored.
- ``close(timeout)`` runs the operations already queued, then stops the
  thread; idempotent.
- ``optimizer=None``: the store's default (a push replaces the value with the
  pushed sum) for keys whose ``init`` brings no spec; a key whose ``init``
  brings an :class:`~gradhub.optim.OptimizerSpec` gets that optimizer. With an
  ``optimizer`` (factory or spec) the server is fixed to it, and an ``init``
  bringing a different spec is an ``OptimizerMismatchError``. See
  :mod:`gradhub.ps.server.store`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from gradhub.errors import (
    ClosedError,
    GradhubTimeoutError,
    InvalidOptionError,
    NonFiniteError,
    UnknownParameterError,
    WrongTypeError,
)
from gradhub.optim import OptimizerFactory, OptimizerSpec
from gradhub.ps.base import ParameterServer, Replicas, as_replicas, check_key, check_like
from gradhub.ps.lanes import PriorityLanes
from gradhub.ps.server.store import ParameterStore
from gradhub.trees import all_finite

logger = logging.getLogger(__name__)


@dataclass
class _Op:
    run: Callable[[], None]
    future: Future[None] = field(default_factory=Future)


class LocalParameterServer(ParameterServer):
    """A parameter server in this process.

    Args:
        optimizer: an :class:`~gradhub.optim.OptimizerSpec` or a factory
            ``list[Tensor] -> torch.optim.Optimizer``, built once per key;
            ``None``: keys take the spec their ``init`` brings, and without
            one a push replaces the value with the sum.
    """

    def __init__(self, optimizer: OptimizerFactory | OptimizerSpec | None = None) -> None:
        self._store = ParameterStore(optimizer)
        self._store_lock = threading.Lock()  # held while an op or init touches the store
        self._cond = threading.Condition()  # guards the queues and _known below
        self._queue: PriorityLanes[str, _Op] = PriorityLanes()
        # The stored tensors by key, for call-time checks without waiting for a
        # running op (a stored tensor's shape, dtype and device never change).
        self._known: dict[str, torch.Tensor] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="gradhub-local-ps", daemon=True)
        self._thread.start()

    # -------------------------------------------------------------- interface
    def init(self, key: str, values: Replicas, *, optimizer: OptimizerSpec | None = None) -> None:
        self._check_open()
        check_key(key)
        replicas = as_replicas(values, what="values")
        with self._store_lock:
            self._store.init(key, replicas[0], optimizer=optimizer)
            with self._cond:
                self._known[key] = self._store.value(key)

    def push(
        self,
        key: str,
        grads: Replicas,
        *,
        priority: int = 0,
        hyperparameters: Mapping[str, Any] | None = None,
    ) -> Future[None]:
        self._check_open()
        check_key(key)
        replicas = as_replicas(grads, what="grads")
        device = self._check(key, replicas[0]).device
        total = replicas[0].detach().to(device=device, copy=True)
        for g in replicas[1:]:
            total.add_(g.detach().to(device))
        if total.is_floating_point() and not all_finite(total):
            raise NonFiniteError(f"push of {key!r} holds NaN or infinity; nothing was queued")
        hyper = dict(hyperparameters) if hyperparameters else None
        return self._submit(key, priority, lambda: self._store.apply(key, total, hyper))

    def pull(self, key: str, weights: Replicas, *, priority: int = 0) -> Future[None]:
        self._check_open()
        check_key(key)
        targets = as_replicas(weights, what="weights")
        self._check(key, targets[0])
        return self._submit(key, priority, lambda: self._store.copy_into(key, targets))

    def optimizer_state(
        self, key: str, like: torch.Tensor | None = None, *, timeout: float = 60.0
    ) -> dict[str, Any]:
        """The state of ``key``'s optimizer once the operations queued before are done."""
        box: list[dict[str, Any]] = []
        self._run_in_order(key, like, lambda: box.append(self._store.optimizer_state(key)), timeout)
        return box[0]

    def set_optimizer_state(
        self,
        key: str,
        state: Mapping[str, Any],
        like: torch.Tensor | None = None,
        *,
        timeout: float = 60.0,
    ) -> None:
        """Replace the state of ``key``'s optimizer, after the operations queued before."""
        given = dict(state)
        self._run_in_order(key, like, lambda: self._store.set_optimizer_state(key, given), timeout)

    def _run_in_order(
        self, key: str, like: torch.Tensor | None, run: Callable[[], None], timeout: float
    ) -> None:
        self._check_open()
        check_key(key)
        if like is not None:
            self._check(key, like)
        else:
            self._check_known(key)
        if self._store.optimizer(key) is None:
            raise InvalidOptionError(
                f"{key!r} has no optimizer on this server, so no optimizer state\n- help: give "
                "the key an optimizer at init (optimizer=OptimizerSpec.of(...)), or the server one"
            )
        future = self._submit(key, 0, run)
        try:
            future.result(timeout)
        except TimeoutError:
            raise GradhubTimeoutError(
                f"the local parameter server did not reach {key!r} within {timeout}s"
            ) from None

    def close(self, timeout: float | None = 60.0) -> None:
        """Run what is queued, stop the worker thread; idempotent."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise GradhubTimeoutError(
                f"local parameter server did not finish its queued operations within {timeout}s"
            )

    # ------------------------------------------------------------------ extras
    def __enter__(self) -> LocalParameterServer:
        return self

    @property
    def store(self) -> ParameterStore:
        """The underlying store (read it only when no operation is pending)."""
        return self._store

    def keys(self) -> list[str]:
        with self._cond:
            return list(self._known)

    @property
    def pending(self) -> int:
        """Operations queued and not yet started."""
        with self._cond:
            return len(self._queue)

    def state_dict(self) -> dict[str, Any]:
        """Values and optimizer state of every key (operations running now finish first)."""
        with self._store_lock:
            return self._store.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; see :meth:`ParameterStore.load_state_dict`."""
        self._check_open()
        with self._store_lock:
            self._store.load_state_dict(state)
            with self._cond:
                self._known = {k: self._store.value(k) for k in self._store}

    def get(self, key: str) -> torch.Tensor:
        """A copy of the current value of ``key`` (queued operations not awaited)."""
        with self._store_lock:
            return self._store.value(key).detach().clone()

    # ---------------------------------------------------------------- machinery
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this LocalParameterServer is closed; create a new one")

    def _check(self, key: str, given: torch.Tensor) -> torch.Tensor:
        """The stored tensor of ``key`` after checking ``given`` against it."""
        stored = self._check_known(key)
        check_like(key, stored, given)
        return stored

    def _check_known(self, key: str) -> torch.Tensor:
        with self._cond:
            stored = self._known.get(key)
        if stored is None:
            raise UnknownParameterError(
                f"unknown parameter key {key!r}; call init({key!r}, ...) first"
            )
        return stored

    def _submit(self, key: str, priority: int, run: Callable[[], None]) -> Future[None]:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise WrongTypeError(f"priority must be an int, got {priority!r}")
        with self._cond:
            self._check_open()  # close() may have won the race since the first check
            op = _Op(run)
            self._queue.push(key, op, priority)
            self._cond.notify()
        return op.future

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                taken = self._queue.pop()
                if taken is None:
                    return  # closed and drained
                key, op = taken
            if not op.future.set_running_or_notify_cancel():
                continue
            try:
                with self._store_lock:
                    op.run()
            except BaseException as exc:
                logger.warning("parameter server operation on %r failed: %r", key, exc)
                op.future.set_exception(exc)
            else:
                op.future.set_result(None)
