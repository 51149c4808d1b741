"""One collective operation in progress, and the future of one that runs later.

:class:`Operation` carries an operation's name, sequence number and deadline
(:meth:`gradhub.transports.group.CollectiveGroup.begin` makes one);
:class:`CollectiveFuture` is what the group's worker thread hands back.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Generic, TypeVar

from gradhub.errors import CollectiveTimeoutError

_FUTURE_GRACE = 10.0
"""Seconds a future waits beyond its operation's own deadline before it gives up
on the worker thread."""

T = TypeVar("T")


@dataclass
class Operation:
    """One collective in progress: its name, sequence number and deadline."""

    name: str
    sequence: int
    timeout: float
    deadline: float
    messages: int = 0
    """Point-to-point messages this operation has tagged so far: an operation
    made of several steps (an all-reduce's reduce-scatter and all-gather) gives
    each message its own tag."""

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class CollectiveFuture(Generic[T]):
    """The result of an operation running on a group's worker thread.

    ``wait()`` returns the result or raises the operation's error. It never
    waits forever: an operation is bounded by its own timeout once it starts,
    and operations queued before it are bounded by theirs.
    """

    def __init__(self, operation: str, timeout: float):
        self._future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._operation = operation
        self._timeout = timeout
        self._started: float | None = None

    def _mark_started(self) -> None:
        self._started = time.monotonic()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | timedelta | None = None) -> T:
        """The operation's result. ``timeout`` bounds this call (seconds, or a
        ``timedelta`` as c10d's ``Work.wait`` takes); by default it waits as
        long as the operation (and those before it) may take."""
        if isinstance(timeout, timedelta):
            timeout = timeout.total_seconds()
        begin = time.monotonic()
        while True:
            left = None if timeout is None else begin + timeout - time.monotonic()
            try:
                # exception() returns the operation's own error (which may be a
                # TimeoutError too) and raises TimeoutError only when the slice ends.
                self._future.exception(timeout=0.5 if left is None else max(min(left, 0.5), 0))
            except TimeoutError:
                self._check_waited(begin, timeout)
                continue
            return self._future.result()

    def _check_waited(self, begin: float, timeout: float | None) -> None:
        """Give up when the caller's ``timeout`` or the operation's own deadline
        (plus a grace) has passed."""
        now = time.monotonic()
        if timeout is not None and now - begin >= timeout:
            raise CollectiveTimeoutError(
                self._operation, [], timeout, "the caller's wait ran out first"
            )
        started = self._started
        if started is not None and now - started > self._timeout + _FUTURE_GRACE:
            raise CollectiveTimeoutError(
                self._operation,
                [],
                self._timeout,
                "the operation did not return past its own deadline",
            )
