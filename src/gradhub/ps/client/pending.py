"""The futures of a client's requests: waiting on one drives the channel.

:class:`Pending` is the future :meth:`~gradhub.ps.client.channel.Channel.submit`
returns: a thread that waits on it (:meth:`~Pending.result`,
:meth:`~Pending.exception`) sends and receives for the channel itself until it
is done (:meth:`~gradhub.ps.client.channel.Channel.wait`), so a reply wakes the thread
that waits for it. :func:`all_of` joins the futures of a request's pieces.

A :class:`Pending` is a ``concurrent.futures.Future`` in every respect (its
state, waiters and callbacks, for ``concurrent.futures.wait`` too), except that
its ``threading.Condition`` is made on first use: most requests are answered
and read by the thread that made them, which never needs it (making one, and
taking it to set and to read the result, was a sixth of a small push's Python
work on the client).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import _base as futures
from typing import Protocol

__all__ = ["Driver", "Pending", "all_of"]


class Driver(Protocol):
    """What a :class:`Pending` waits through (the channel)."""

    def wait(self, future: Pending, timeout: float | None) -> None:
        """Drive the sockets until ``future`` is done or ``timeout`` seconds passed."""


_DONE = (futures.CANCELLED, futures.CANCELLED_AND_NOTIFIED, futures.FINISHED)
_MAKING = threading.Lock()  # held while a future's condition is made, or found missing


class Pending(Future[None]):
    """The future of a request (or of several): a thread waiting on it with
    :meth:`result` or :meth:`exception` drives the channel itself until it is done."""

    def __init__(self, channel: Driver) -> None:  # Future's state, but no condition yet
        self._state = futures.PENDING
        self._result = None
        self._exception = None
        self._waiters = []
        self._done_callbacks: list[Callable[[Future[None]], object]] = []
        self._channel = channel
        self.finished = False
        """Set once done (result, exception or cancelled): read without the future's lock."""

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        """Future's condition, made by the first one who needs it: whoever waits
        on it, adds a callback or a waiter, cancels, or fails the future."""
        made: threading.Condition | None = self.__dict__.get("_made")
        if made is None:
            with _MAKING:
                made = self.__dict__.get("_made")
                if made is None:
                    made = self.__dict__["_made"] = threading.Condition()
        return made

    def set_result(self, result: None) -> None:
        with _MAKING:
            if "_made" not in self.__dict__:
                # No condition: nobody waits on it and no callback or waiter was added
                # (each makes it first), so there is no one to notify.
                if self._state in _DONE:
                    raise InvalidStateError(f"the future is already {self._state}")
                self._result = result
                self._state = futures.FINISHED
                self.finished = True
                return
        super().set_result(result)
        self.finished = True

    def set_exception(self, exception: BaseException | None) -> None:
        super().set_exception(exception)
        self.finished = True

    def cancel(self) -> bool:
        cancelled = super().cancel()
        self.finished = self.finished or cancelled
        return cancelled

    def done(self) -> bool:
        return self.finished or self._state in _DONE  # one read: no lock to take

    def result(self, timeout: float | None = None) -> None:
        if not self.finished:
            timeout = self._drive(timeout)
        if self._state == futures.FINISHED and self._exception is None:
            return self._result  # final once set: read without the condition
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(self._drive(timeout))

    def _drive(self, timeout: float | None) -> float | None:
        """Drive until done or ``timeout``; the time left of ``timeout``."""
        if self.finished or self.done():
            return timeout
        if timeout is None:
            self._channel.wait(self, None)
            return None
        start = time.monotonic()
        self._channel.wait(self, timeout)
        return max(0.0, timeout - (time.monotonic() - start))


def all_of(channel: Driver, futures: list[Future[None]]) -> Future[None]:
    """A future done when all of ``futures`` are; it fails with the first failure
    (waiting on it drives ``channel``, as waiting on one of them does)."""
    if len(futures) == 1:
        return futures[0]
    out = Pending(channel)
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(f: Future[None]) -> None:
        exc = f.exception()
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
            if out.done():
                return
            if exc is not None:
                out.set_exception(exc)
            elif last:
                out.set_result(None)

    for f in futures:
        f.add_done_callback(done)
    return out
