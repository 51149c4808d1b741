"""DistributedGradientsCoordinator: workers add gradients, one thread applies them.

Any number of worker threads call :meth:`~DistributedGradientsCoordinator.add_gradients`;
a background thread (or :meth:`~DistributedGradientsCoordinator.apply_pending`)
applies the queued gradients to the main parameters one at a time, first in,
first out: ``theta <- theta - lr * g`` in ``"descent"`` mode and
``theta <- theta + lr * g`` in ``"ascent"`` mode.

Decisions:

- A gradient is validated *when it is added*: structure and shapes against the
  parameters' :class:`~gradhub.trees.TreeSpec` (``ShapeMismatchError``), then
  finiteness (``NonFiniteError`` under ``nonfinite="error"``; silently dropped
  under ``"skip"``). A refused gradient is never queued and counts in
  ``rejected``. The non-finite check costs one read of the gradient (a sum)
  in the caller's thread, not in the apply thread.
- ``copy=True`` snapshots the gradient at once, converted to each parameter's
  dtype and device, so the caller may reuse its buffers. ``copy=False`` queues
  the caller's tensors: they must not change until applied.
- Apply is one in-place ``param.add_(grad, alpha=+-lr)`` per leaf under
  ``torch.no_grad()``: it reads the parameter and the gradient once and writes
  the parameter once, the traffic of ``a += b``. Parameters given with
  ``copy=False`` are updated in place, so the caller sees every step.
- One lock (``_params_lock``) is held while a gradient is taken off the queue
  *and* applied, so two appliers (the thread and ``apply_pending``) cannot
  reorder gradients, and :meth:`get_model_parameters` sees whole steps only.
  The queue has its own condition variable; adders never wait for an apply.
- ``add_gradients`` returns the gradient's sequence number (1, 2, ...; ``None``
  when skipped); ``on_applied(seq)`` (optional) is called in the applying
  thread after each apply, and :meth:`wait_applied` blocks until a sequence
  number has been applied: how a caller learns that its gradient took effect.
- The context manager starts on enter and stops (draining) on exit; the
  parameters stay readable. :meth:`close` stops and refuses any further use.
- Changing the parameters' structure with :meth:`set_model_parameters` while
  gradients are queued is a ``StateError`` (they were validated against the
  old structure): apply or clear them first.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
from collections.abc import Callable
from types import TracebackType

import torch

from gradhub.errors import (
    ClosedError,
    GradhubTimeoutError,
    InvalidOptionError,
    NonFiniteError,
    StateError,
    WrongTypeError,
)
from gradhub.trees import Tree, TreeSpec, all_finite, as_tree, clone_tree

logger = logging.getLogger(__name__)

_MODES = {"descent": -1.0, "ascent": 1.0}
_NONFINITE = ("error", "skip")


def _check_mode(mode: str) -> str:
    key = mode.lower() if isinstance(mode, str) else mode
    if key not in _MODES:
        raise InvalidOptionError(
            f"gradient_change_mode must be 'descent' or 'ascent', got {mode!r}"
        )
    return str(key)


def _check_learning_rate(lr: float) -> float:
    value = float(lr)
    if not math.isfinite(value) or value < 0:
        raise InvalidOptionError(f"learning_rate must be a finite number >= 0, got {lr!r}")
    return value


def _check_nonfinite(policy: str) -> str:
    if policy not in _NONFINITE:
        raise InvalidOptionError(f"nonfinite must be 'error' or 'skip', got {policy!r}")
    return policy


class DistributedGradientsCoordinator:
    """Applies gradients from many workers to one set of parameters, in real time.

    Args:
        gradient_change_mode: ``"descent"`` or ``"ascent"`` (case-insensitive).
        learning_rate: scale of each gradient (default 1.0: gradients are
            applied whole; workers scale their own).
        nonfinite: ``"error"`` (default) refuses a gradient holding NaN or
            infinity with ``NonFiniteError``; ``"skip"`` drops it silently.
        on_applied: called with the sequence number of each applied gradient,
            in the applying thread, outside no lock the caller can see. It must
            be quick and must not call back into the coordinator's apply methods.
    """

    def __init__(
        self,
        gradient_change_mode: str = "descent",
        *,
        learning_rate: float = 1.0,
        nonfinite: str = "error",
        on_applied: Callable[[int], None] | None = None,
    ) -> None:
        self._mode = _check_mode(gradient_change_mode)
        self._lr = _check_learning_rate(learning_rate)
        self._nonfinite = _check_nonfinite(nonfinite)
        self._on_applied = on_applied

        self._params: Tree | None = None
        self._leaves: list[torch.Tensor] = []
        self._spec: TreeSpec | None = None

        self._params_lock = threading.Lock()
        self._queue: collections.deque[tuple[int, list[torch.Tensor]]] = collections.deque()
        self._cond = threading.Condition()
        self._next_seq = 1
        self._applied = 0
        self._last_applied_seq = 0
        self._in_flight: int | None = None
        self._rejected = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._drain = True
        self._closed = False
        self._thread_error: BaseException | None = None

    # ----------------------------------------------------------- configuration
    @property
    def gradient_change_mode(self) -> str:
        return self._mode

    @property
    def learning_rate(self) -> float:
        return self._lr

    def set_parameters(
        self, gradient_change_mode: str | None = None, learning_rate: float | None = None
    ) -> None:
        """Change the mode and/or learning rate; ``None`` keeps the current value.

        Takes effect from the next gradient applied (queued ones included).
        """
        mode = self._mode if gradient_change_mode is None else _check_mode(gradient_change_mode)
        lr = self._lr if learning_rate is None else _check_learning_rate(learning_rate)
        with self._params_lock:
            self._mode, self._lr = mode, lr

    def set_model_parameters(self, model_parameters: Tree, copy: bool = True) -> None:
        """Set the main parameters (a tensor or a tree of tensors; NumPy accepted).

        ``copy=False`` keeps the caller's tensors, which are then updated in place
        (NumPy arrays share memory with the tensors made from them).
        """
        self._check_open()
        tree = as_tree(model_parameters)
        spec = TreeSpec.of(tree)
        leaves = spec.leaves(tree)
        for i, leaf in enumerate(leaves):
            if not leaf.is_floating_point():
                raise WrongTypeError(
                    f"parameter leaf {i} has dtype {leaf.dtype}; parameters must be floating point"
                )
        if copy:
            tree = clone_tree(tree)
            leaves = spec.leaves(tree)
        with self._params_lock, self._cond:
            if self._queue and spec != self._spec:
                raise StateError(
                    f"{len(self._queue)} queued gradient(s) were validated against the old "
                    "parameter structure; call apply_pending() or clear_gradients() first"
                )
            self._params, self._spec, self._leaves = tree, spec, leaves

    def get_model_parameters(self, copy: bool = True) -> Tree:
        """The main parameters: a consistent snapshot (``copy=True``) or the live tree.

        A snapshot never shows half of a step. Raises ``StateError`` if none are set.
        """
        with self._params_lock:
            if self._params is None:
                raise StateError("no model parameters set; call set_model_parameters() first")
            return clone_tree(self._params) if copy else self._params

    # ----------------------------------------------------------------- adding
    def add_gradients(
        self, gradients: Tree, copy: bool = True, *, nonfinite: str | None = None
    ) -> int | None:
        """Queue one gradient (same structure and shapes as the parameters).

        Returns its sequence number, or ``None`` if it was skipped as non-finite.
        ``nonfinite`` overrides the coordinator's policy for this call. Raises
        ``ShapeMismatchError`` or ``NonFiniteError`` with nothing queued.
        """
        self._check_open()
        policy = self._nonfinite if nonfinite is None else _check_nonfinite(nonfinite)
        with self._cond:  # set_model_parameters swaps both under this lock
            spec, params = self._spec, self._leaves
        if spec is None:
            raise StateError("no model parameters set; call set_model_parameters() first")
        try:
            grads = spec.leaves(gradients)
            for i, g in enumerate(grads):
                if g.is_floating_point() and not all_finite(g):
                    if policy == "skip":
                        with self._cond:
                            self._rejected += 1
                        return None
                    raise NonFiniteError(
                        f"gradient leaf {i} of {len(grads)} holds NaN or infinity; "
                        "fix the worker or pass nonfinite='skip' to drop such gradients"
                    )
        except (ValueError, TypeError):
            with self._cond:
                self._rejected += 1
            raise
        if copy:
            grads = [
                g.detach().to(dtype=p.dtype, device=p.device, copy=True)
                for g, p in zip(grads, params, strict=True)
            ]
        else:
            grads = [g.detach() for g in grads]
        with self._cond:
            seq = self._next_seq
            self._next_seq += 1
            self._queue.append((seq, grads))
            self._cond.notify_all()
        return seq

    # --------------------------------------------------------------- applying
    def _apply_one(self) -> bool:
        """Take the oldest gradient off the queue and apply it. False if none."""
        with self._params_lock:
            with self._cond:
                if not self._queue:
                    return False
                seq, grads = self._queue.popleft()
                self._in_flight = seq
            alpha = _MODES[self._mode] * self._lr
            done = False
            try:
                with torch.no_grad():
                    for p, g in zip(self._leaves, grads, strict=True):
                        p.add_(g, alpha=alpha)
                done = True
            finally:
                with self._cond:
                    self._in_flight = None
                    if done:
                        self._applied += 1
                        self._last_applied_seq = seq
                    self._cond.notify_all()
        if self._on_applied is not None:
            self._on_applied(seq)
        return True

    def apply_pending(self) -> int:
        """Apply every queued gradient now, in this thread; returns how many."""
        self._check_open()
        count = 0
        while self._apply_one():
            count += 1
        return count

    def clear_gradients(self) -> int:
        """Drop every queued gradient; returns how many were dropped."""
        with self._cond:
            count = len(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        return count

    def wait_applied(self, seq: int | None = None, timeout: float | None = 60.0) -> None:
        """Block until gradient ``seq`` (default: every gradient added so far) is applied
        or dropped by :meth:`clear_gradients`. Raises ``GradhubTimeoutError``."""
        with self._cond:
            target = self._next_seq - 1 if seq is None else seq

            def done() -> bool:
                if self._last_applied_seq >= target:
                    return True
                queued = bool(self._queue) and self._queue[0][0] <= target
                in_flight = self._in_flight is not None and self._in_flight <= target
                return not queued and not in_flight

            if not self._cond.wait_for(done, timeout=timeout):
                raise GradhubTimeoutError(
                    f"gradient {target} not applied within {timeout}s "
                    f"({len(self._queue)} pending); is the coordinator started?"
                )

    # ----------------------------------------------------------------- thread
    def start(self) -> threading.Thread:
        """Start the apply thread and return it.

        ``StateError`` if no parameters are set or the thread already runs.
        """
        self._check_open()
        with self._cond:
            if self._spec is None:
                raise StateError("no model parameters set; call set_model_parameters() first")
            if self._thread is not None and self._thread.is_alive():
                raise StateError("the coordinator is already running; call stop() first")
            self._stopping = False
            self._thread_error = None
            thread = threading.Thread(target=self._run, name="gradhub-coordinator", daemon=True)
            self._thread = thread
        thread.start()
        return thread

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: bool(self._queue) or self._stopping)
                    if self._stopping and (not self._drain or not self._queue):
                        return
                self._apply_one()
        except BaseException as exc:  # keep it for stop(); the thread must not die silently
            logger.exception("coordinator apply thread failed")
            self._thread_error = exc

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def stop(self, drain: bool = True, timeout: float | None = 60.0) -> None:
        """Stop the apply thread; idempotent.

        ``drain=True`` applies every queued gradient first; ``drain=False``
        leaves the queue as it is. Raises ``GradhubTimeoutError`` if the thread
        does not finish within ``timeout`` seconds, and re-raises an error that
        stopped the thread.
        """
        with self._cond:
            thread = self._thread
            if thread is None:
                return
            self._stopping = True
            self._drain = drain
            self._cond.notify_all()
        thread.join(timeout)
        if thread.is_alive():
            raise GradhubTimeoutError(
                f"coordinator thread did not stop within {timeout}s "
                f"({self.pending} gradient(s) still queued)"
            )
        self._thread = None
        error, self._thread_error = self._thread_error, None
        if error is not None:
            raise StateError(f"the apply thread failed: {error!r}") from error

    def close(self) -> None:
        """Stop (draining) and refuse any further use; idempotent."""
        if self._closed:
            return
        try:
            self.stop(drain=True)
        finally:
            self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this DistributedGradientsCoordinator is closed; create a new one")

    def __enter__(self) -> DistributedGradientsCoordinator:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Drain on a normal exit; after an exception leave the queue as it is.
        self.stop(drain=exc_type is None)

    # --------------------------------------------------------------- counters
    @property
    def applied(self) -> int:
        """Gradients applied so far."""
        return self._applied

    @property
    def pending(self) -> int:
        """Gradients queued and not yet applied."""
        return len(self._queue)

    @property
    def rejected(self) -> int:
        """Gradients refused by :meth:`add_gradients` (bad shape, non-finite, skipped)."""
        return self._rejected

    def __repr__(self) -> str:
        return (
            f"DistributedGradientsCoordinator({self._mode!r}, learning_rate={self._lr}, "
            f"applied={self.applied}, pending={self.pending}, rejected={self.rejected})"
        )
