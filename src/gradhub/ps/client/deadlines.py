"""A client's requests against the clock: what retries, cancels and gives up.

:class:`Deadlines` checks the requests of a channel's
:class:`~gradhub.ps.client.exchange.Exchange` (the channel calls
:meth:`~Deadlines.check_timers` every tick) and sends and releases through it.

- Every request has a deadline (``timeout``); past it its future fails with
  :class:`~gradhub.errors.ServerTimeoutError` naming the server and key.
- A request not answered within ``retry_interval`` is sent again (same
  numbers: the server applies it once); a hello, likewise.
- Requests to a server that never answered a hello fail with
  :class:`~gradhub.errors.ServerUnavailableError` after ``connect_timeout``.
- A pull that named a user's arena tensor is cancelled first
  (:mod:`gradhub.ps.client.shared_tensors`): it fails once the server confirmed it will
  not write into the tensor, or once its process is gone; a server that
  confirms nothing within another ``timeout`` fails it with a message saying
  the tensor may still change.
"""

from __future__ import annotations

from gradhub.errors import ServerTimeoutError, ServerUnavailableError
from gradhub.ps.client.exchange import Exchange
from gradhub.ps.client.link import MUTATING, Link, Request

__all__ = ["Deadlines"]


class Deadlines:
    """The deadline checks of a client's exchange with its servers (called, as the
    exchange is, with the sockets' lock held)."""

    def __init__(self, exchange: Exchange, *, connect_timeout: float) -> None:
        self._exchange = exchange
        self._servers = exchange.servers
        self.timeout = exchange.timeout
        self.retry_interval = exchange.retry_interval
        self.connect_timeout = connect_timeout

    def check_timers(self, now: float) -> None:
        """Fail, retry or cancel what is due at ``now``."""
        for i, s in enumerate(self._servers):
            if s.failure is not None:
                continue
            if not s.connected_before:
                late = s.queue.remove_if(lambda r: now >= r.submitted + self.connect_timeout)
                for req in late:
                    if req.future is not None and not req.future.done():
                        req.future.set_exception(
                            ServerUnavailableError(s.address, self.connect_timeout)
                        )
            if s.hello is not None and now >= s.hello.next_retry:
                self._exchange.send_hello(i, s, now)
            for rid, req in list(s.inflight.items()):
                if now >= req.deadline:
                    if self._cancel(s, req, now):
                        continue  # in flight until the server confirms
                    del s.inflight[rid]
                    if req.op in MUTATING:
                        s.inflight_bytes -= req.nbytes
                    self._expire(s, req)
                elif now >= req.next_retry and s.incarnation:
                    req.next_retry = now + self.retry_interval
                    self._exchange.send(s, req)
            for req in s.queue.remove_if(lambda r: now >= r.deadline):
                self._expire(s, req)

    def _cancel(self, s: Link, req: Request, now: float) -> bool:
        """At its deadline, a pull that named a user's tensor: ask the server not to
        write into it, and wait up to another ``timeout`` for it to confirm
        (:meth:`confirmed`); whether it waits."""
        if not req.named_user or req.cancelling or s.arena is None:
            return False
        try:
            s.arena.cancel(req.request_id)
        except OSError:
            return False
        req.cancelling = True
        req.deadline, req.next_retry = now + self.timeout, float("inf")
        return True

    def confirmed(self, s: Link) -> None:
        """Fail the pulls whose cancel the server confirmed (see :meth:`_cancel`)."""
        while s.arena is not None and s.arena.confirmed:
            req = s.inflight.pop(s.arena.confirmed.pop(), None)
            if req is not None:
                req.cancelling = False  # settled: the server will not write into it
                self._expire(s, req)

    def _expire(self, s: Link, req: Request) -> None:
        self._exchange.release(s, req, answered=False)
        if req.future is not None and not req.future.done():
            op = req.op.name.lower()
            why = ""
            if req.cancelling:
                why = (
                    "nor confirmed within another timeout that it will not write into the "
                    "tensor: its bytes may still change"
                )
            req.future.set_exception(
                ServerTimeoutError(s.address, req.user_key or None, op, self.timeout, why)
            )
