"""The futures of a client's requests: waiting on one drives the channel.

:class:`Pending` is the future :meth:`~gradhub.ps.channel.Channel.submit`
returns: a thread that waits on it (:meth:`~Pending.result`,
:meth:`~Pending.exception`) sends and receives for the channel itself until it
is done (:meth:`~gradhub.ps.channel.Channel.wait`), so a reply wakes the thread
that waits for it. :func:`all_of` joins the futures of a request's pieces.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Protocol

__all__ = ["Driver", "Pending", "all_of"]


class Driver(Protocol):
    """What a :class:`Pending` waits through (the channel)."""

    def wait(self, future: Pending, timeout: float | None) -> None:
        """Drive the sockets until ``future`` is done or ``timeout`` seconds passed."""


class Pending(Future[None]):
    """The future of a request (or of several): a thread waiting on it with
    :meth:`result` or :meth:`exception` drives the channel itself until it is done."""

    def __init__(self, channel: Driver) -> None:
        super().__init__()
        self._channel = channel
        self.finished = False
        """Set once done (result, exception or cancelled): read without the future's lock."""

    def set_result(self, result: None) -> None:
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
        return self.finished or super().done()  # finished: no lock to take

    def result(self, timeout: float | None = None) -> None:
        return super().result(timeout if self.finished else self._drive(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(self._drive(timeout))

    def _drive(self, timeout: float | None) -> float | None:
        """Drive until done or ``timeout``; the time left of ``timeout``."""
        if self.finished or self.done():
            return timeout
        start = time.monotonic()
        self._channel.wait(self, timeout)
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))


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
