"""The ``Work`` an operation of the gradhub backend returns at once.

An operation runs later, on its group's worker thread (or, for point-to-point
messages, on gloo's), or, when it is small and nothing is queued before it,
on the calling thread before the call returns; :class:`GradhubWork` is its
handle either way (:class:`DoneWork`, which answers the same, for one that
finished without error before its call returned):

- ``wait(timeout)`` blocks until it finished, at most ``timeout`` (a
  ``timedelta``; zero or none: as long as the operation itself may take, which
  its group's timeout bounds), and raises the operation's error: a
  :class:`~gradhub.errors.WorkerFailedError` or
  :class:`~gradhub.errors.CollectiveTimeoutError` naming the rank.
- ``get_future()`` is a ``torch.futures.Future`` that resolves to the list of
  output tensors (DDP's reducer reads the bucket from it and never calls
  ``wait()``).

Decision (checked on torch 2.13): failing a future with ``set_exception``
makes DDP's backward crash the process (SIGSEGV), whereas an exception raised
inside a ``.then()`` callback reaches DDP as a ``RuntimeError`` with the
message kept. So the worker always completes a private future with an
outcome, and the future handed out is that future's ``.then()`` of a callback
that returns the outputs or raises the error.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradhub.errors import CollectiveTimeoutError
from gradhub.transports.c10d_errors import translate

WAIT_GRACE = 10.0
"""Seconds a ``wait()`` without its own timeout allows beyond the operation's
deadline before it gives up on the worker thread itself."""


@dataclass
class _Outcome:
    outputs: list[torch.Tensor]
    error: BaseException | None


def _unwrap(fut: torch.futures.Future[_Outcome]) -> list[torch.Tensor]:
    outcome = fut.value()
    if outcome.error is not None:
        raise outcome.error
    return outcome.outputs


class GradhubWork(dist._Work):
    """One operation of a gradhub process group; see the module docstring.

    An operation that ran on the calling thread is done before anyone holds
    its work, so the event a waiter sleeps on and the futures are made only
    when asked for (:meth:`wait` of a pending one, :meth:`get_future`)."""

    def __init__(self, name: str, rank: int, timeout: float, outputs: list[torch.Tensor]):
        super().__init__()
        self.name = name
        self._rank = rank
        self._timeout = timeout
        self._outputs = outputs
        self._lock = threading.Lock()
        self._complete = False
        self._done: threading.Event | None = None
        self._error: BaseException | None = None
        self._started: float | None = None
        self._raw: torch.futures.Future[_Outcome] | None = None
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None

    # ------------------------------------------------------- worker side
    def _start(self) -> None:
        self._started = time.monotonic()

    def _finish(self, error: BaseException | None = None) -> None:
        """Record the outcome, wake the waiters and resolve the future (its
        callbacks run here)."""
        with self._lock:
            self._error = error
            self._complete = True
            done, raw = self._done, self._raw
        if done is not None:
            done.set()
        if raw is not None:
            raw.set_result(_Outcome(self._outputs, error))

    # -------------------------------------------------------- caller side
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        if not self._complete:
            self._sleep(timeout.total_seconds() if isinstance(timeout, timedelta) else timeout)
        if self._error is not None:
            raise self._error
        return True

    def _sleep(self, limit: float | None) -> None:
        """Wait until the operation finished, at most ``limit`` seconds (none or
        zero: as long as the operation itself may take, plus :data:`WAIT_GRACE`)."""
        with self._lock:
            if self._complete:
                return
            if self._done is None:
                self._done = threading.Event()
            done = self._done
        begin = time.monotonic()
        while not done.wait(0.2):
            now = time.monotonic()
            if limit is not None and limit > 0 and now - begin >= limit:
                raise CollectiveTimeoutError(
                    f"[rank {self._rank}] {self.name}", [], limit, "the caller's wait ran out"
                )
            started = self._started
            if started is not None and now - started > self._timeout + WAIT_GRACE:
                raise CollectiveTimeoutError(
                    f"[rank {self._rank}] {self.name}",
                    [],
                    self._timeout,
                    "the operation did not return past its own deadline",
                )

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        with self._lock:
            if self._future is not None:
                return self._future
            raw: torch.futures.Future[_Outcome] = torch.futures.Future()
            future = raw.then(_unwrap)
            self._raw, self._future = raw, future
            resolve = self._complete
        if resolve:  # finished before anyone asked: resolved here (callbacks run here)
            raw.set_result(_Outcome(self._outputs, self._error))
        return future

    def is_completed(self) -> bool:
        return self._complete

    def is_success(self) -> bool:
        return self._complete and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def __repr__(self) -> str:
        state = "done" if self._complete else "pending"
        return f"GradhubWork({self.name!r}, {state})"


class DoneWork(GradhubWork):
    """An operation that finished without error on the calling thread before its
    call returned: the same answers, with nothing to lock, time or wake (made
    in a third of a pending one's time: 1 us of a small all-reduce's 11)."""

    def __init__(self, name: str, outputs: list[torch.Tensor]):
        dist._Work.__init__(self)  # not GradhubWork's: no lock, event or clock to set up
        self.name = name
        self._outputs = outputs
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        if self._future is None:
            future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
            future.set_result(self._outputs)
            self._future = future
        return self._future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> BaseException | None:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def __repr__(self) -> str:
        return f"GradhubWork({self.name!r}, done)"


class PeerWork(dist._Work):
    """A point-to-point message on the group's gloo group, whose failure names the peer.

    gloo bounds the message by the group's timeout; ``wait()`` turns gloo's
    error into :class:`~gradhub.errors.CollectiveTimeoutError` (timed out) or
    :class:`~gradhub.errors.WorkerFailedError` (connection lost;
    :func:`gradhub.transports.c10d_errors.translate`), naming the
    peer (``None``: any source).
    """

    def __init__(self, inner: Any, name: str, rank: int, peer: int | None, timeout: float):
        super().__init__()
        self._inner = inner
        self.name = name
        self._rank = rank
        self._peer = peer
        self._timeout = timeout

    def wait(self, timeout: timedelta | float | None = None) -> bool:
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        try:
            if timeout is None or timeout.total_seconds() <= 0:
                finished = self._inner.wait()
            else:
                finished = self._inner.wait(timeout)
        except RuntimeError as exc:  # c10d's DistError: gloo's timeout or a lost peer
            peers = [] if self._peer is None else [self._peer]
            what = f"[rank {self._rank}] {self.name}"
            raise translate(exc, what=what, timeout=self._timeout, ranks=peers) from exc
        return bool(finished)

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        future: torch.futures.Future[list[torch.Tensor]] = self._inner.get_future()
        return future

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return bool(self._inner.is_success())

    def exception(self) -> Any:
        return self._inner.exception()

    def _source_rank(self) -> int:
        """The rank a receive from any source got its message from (``dist.recv`` reads it)."""
        return int(self._inner._source_rank())

    def __repr__(self) -> str:
        return f"PeerWork({self.name!r}, peer={self._peer})"
