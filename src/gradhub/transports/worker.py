"""A collective group's worker: its operations one at a time, in the order called.

:meth:`Worker.submit` queues an operation on the group's one worker thread
and returns a future (the caller may overlap other work with it).
:meth:`Worker.call` runs an operation whose caller waits for it at once:
on the calling thread itself when nothing is queued or running and the
thread's torch state is that of a fresh thread (so the body computes what it
would on the worker), else on the worker thread. Running in place saves the
two thread hand-offs of a queued operation (wake the worker, wake the
caller), which on a busy machine may each wait for a core.
:meth:`Worker.here` runs one in place on the same terms and says whether it
did (the torch.distributed backend runs its small operations so).

Either way one operation runs at a time (a lock, held by whichever thread
runs one), and an operation called after another on the same thread runs
after it. Operations run on the worker thread's default CUDA stream, so
they follow each other there (they share the group's scratch buffers); one
queued from another stream first waits, on the device, for the work its
caller had queued on that stream (the kernels that wrote its tensors).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from gradhub.transports.operation import CollectiveFuture

T = TypeVar("T")


def _fresh_thread_state(*, but_grad: bool = False) -> bool:
    """Whether this thread's torch state is that of a new thread (the worker's):
    grad on (unless ``but_grad``), no inference mode, autocast or torch function
    or dispatch modes."""
    return (
        (but_grad or torch.is_grad_enabled())
        and not torch.is_inference_mode_enabled()
        and not torch.is_autocast_enabled("cpu")
        and torch._C._len_torch_function_stack() == 0
        and torch._C._len_torch_dispatch_stack() == 0
    )


def _after_callers_stream(fn: Callable[[], T]) -> Callable[[], T]:
    """``fn``, made to start, on the device, after the work queued so far on the
    calling thread's current CUDA stream where that is not its device's default
    stream (the worker's): an event recorded there now, waited for by the
    default stream when ``fn`` runs. No host synchronisation."""
    if not torch.cuda.is_initialized():
        return fn
    stream = torch.cuda.current_stream()
    default = torch.cuda.default_stream(stream.device)
    if stream == default:
        return fn
    ready = torch.cuda.Event()
    ready.record(stream)

    def after() -> T:
        default.wait_event(ready)
        return fn()

    return after


class Worker:
    """The worker of the group of ``rank``; ``alone``: the group has one rank
    (see :meth:`submit`); ``name``: its thread's name, before ``-r<rank>``."""

    def __init__(self, rank: int, *, alone: bool = False, name: str = "gradhub-collective"):
        self._rank = rank
        self._alone = alone
        self._name = name
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # guards _queued and the choice to run in place
        self._queued = 0  # submitted and not finished
        self._running = threading.Lock()  # held while an operation runs

    def submit(self, name: str, timeout: float, fn: Callable[[], T]) -> CollectiveFuture[T]:
        """Run ``fn`` on the worker thread, after every operation submitted before it.

        In a group of one rank no other rank is there to keep in step: ``fn``
        runs at once on the calling thread where nothing is queued or running
        and the thread's state is a fresh thread's but for grad mode (a backward
        hook runs with it off; ``fn`` runs with it on, as on the worker), and the
        future returned is done. That saves two thread hand-offs per operation.
        """
        if self._alone:
            done = self._here(name, timeout, fn)
            if done is not None:
                return done
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"{self._name}-r{self._rank}"
            )
        future: CollectiveFuture[T] = CollectiveFuture(name, timeout)
        body = _after_callers_stream(fn)

        def run() -> T:
            try:
                with self._running:
                    future._mark_started()
                    return body()
            finally:
                with self._lock:
                    self._queued -= 1

        with self._lock:
            self._queued += 1
        try:
            future._future = self._executor.submit(run)
        except BaseException:
            with self._lock:
                self._queued -= 1
            raise
        return future

    def _here(self, name: str, timeout: float, fn: Callable[[], T]) -> CollectiveFuture[T] | None:
        """``fn`` run on the calling thread, as a done future; ``None`` if it may not."""
        future: CollectiveFuture[T] = CollectiveFuture(name, timeout)

        def run() -> None:
            try:
                future._mark_started()
                with torch.enable_grad():
                    future._future.set_result(fn())
            except BaseException as exc:
                future._future.set_exception(exc)

        return future if self.here(run) else None

    def here(self, fn: Callable[[], None]) -> bool:
        """Run ``fn`` on the calling thread, now, if nothing is queued or running
        and the thread's torch state is a fresh thread's but for grad mode (``fn``
        sets the grad mode it needs); whether it ran. ``fn`` must not raise.

        The caller decides when that is worth it: an operation whose work is short
        beside the two thread hand-offs of a queued one (the backend's small
        all-reduces)."""
        if not self.enter():
            return False
        try:
            fn()
        finally:
            self.leave()
        return True

    def enter(self) -> bool:
        """Take the worker for an operation run on the calling thread, on
        :meth:`here`'s terms; whether it was taken (then :meth:`leave` after it)."""
        with self._lock:
            return (
                self._queued == 0
                and _fresh_thread_state(but_grad=True)
                and self._running.acquire(False)
            )

    def leave(self) -> None:
        """Give the worker back after :meth:`enter`."""
        self._running.release()

    def call(self, name: str, timeout: float, fn: Callable[[], T]) -> T:
        """``submit(name, timeout, fn).wait()``, in place where that computes the same."""
        with self._lock:
            here = self._queued == 0 and _fresh_thread_state() and self._running.acquire(False)
        if not here:
            return self.submit(name, timeout, fn).wait()
        try:
            return fn()
        finally:
            self._running.release()

    def shutdown(self) -> None:
        """Finish the queued operations and stop the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
