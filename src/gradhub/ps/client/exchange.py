"""The client's side of the request protocol with each parameter server, without threads.

:class:`Exchange` decides what is sent to each server and when, and what each
answer does. A :class:`~gradhub.ps.client.channel.Channel` owns one: its
threads drive the sockets and call the exchange while holding their lock.

- **Order and credit.** Per server, requests wait in
  :class:`~gradhub.ps.lanes.PriorityLanes` (one lane per key: higher priority
  first, FIFO among equals, one key's requests never reordered) and are sent
  while the pushes in flight stay under ``max_inflight_bytes``, so that a
  high-priority push can pass a queue of low-priority ones (BytePS's credit).
- **Deadlines.** Every request has one (``timeout``), checked by the
  channel's :class:`~gradhub.ps.client.deadlines.Deadlines`, which retries and
  gives up through the exchange.
- **Exactly once.** Pushes and inits carry ``(worker_id, session, seq)``; a
  request not answered within ``retry_interval`` is sent again with the same
  numbers, and the server applies it once.
- **Failures that name the cause.** A server that refuses this client's
  hello (wrong or missing secret) fails its requests with
  ``AuthenticationError`` at once; a server that never answered a hello fails
  them with ``ServerUnavailableError`` after ``connect_timeout``; a server that
  said goodbye without a checkpoint to restart from fails them with
  ``ClosedError`` (with one, the channel waits for it up to the timeout). The
  same error fails later requests to that server at once.
- **Hello and replay.** After a server restart (a new *incarnation*, noticed
  on a heartbeat or a ``STALE_INCARNATION`` answer) the channel says hello
  again and resends, in their original order, the pushes the server had
  acknowledged but not yet made durable (kept until the server reports them
  durable), then everything in flight. ZeroMQ reconnects the socket on its own.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

import zmq

from gradhub.errors import GradhubError, ProtocolError
from gradhub.ps.client.link import MUTATING, Link, Request, closed_error, refused_error
from gradhub.ps.wire import frames as frame_io
from gradhub.ps.wire import protocol, status
from gradhub.ps.wire.protocol import (
    PACK_MAX,
    Header,
    Message,
    Op,
    Status,
    small,
)

log = logging.getLogger(__name__)

_CONTROL_OPS = (Op.HELLO, Op.BYE, Op.HEARTBEAT)  # replies that are not answers to a request


class _Awaited(Protocol):
    finished: bool  # the channel's future (Pending): done, read without its lock


class Exchange:
    """Requests to a list of servers (``servers``, one :class:`Link` each, added by
    the channel): their sends, replies and failures.

    The channel holds the sockets' lock while it calls these methods. It hands
    over the shared arena's set-up, which its I/O thread watches:
    ``start_arena(link, hello_reply)`` connects the arena a hello reply offers,
    ``drop_arena(link)`` stops using one (payloads take the ZeroMQ path).
    ``submitted`` holds the requests callers submitted that are not in a lane
    yet; it and each link's ``failure`` are guarded by ``lock``.
    """

    def __init__(
        self,
        *,
        worker_id: int,
        session: int,
        secret: bytes | None,
        timeout: float,
        heartbeat_interval: float,
        retry_interval: float,
        max_inflight_bytes: int,
        start_arena: Callable[[Link, Message], None],
        drop_arena: Callable[[Link], None],
    ) -> None:
        self.worker_id = worker_id
        self.timeout = timeout
        self.heartbeat_interval = heartbeat_interval
        self.retry_interval = retry_interval
        self.max_inflight_bytes = max_inflight_bytes
        self.dropped_replies = 0
        self._secret = secret
        self.session = session
        self.lock = threading.Lock()
        self.submitted: list[Request] = []
        self.ids = itertools.count(1)
        self.servers: list[Link] = []
        self._aux = int(timeout * 1000)  # every request's aux: how long the server may hold it
        self._start_arena = start_arena
        self._drop_arena = drop_arena

    def send_ready(self, i: int, s: Link, now: float) -> None:
        if s.failure is not None:
            for req in s.queue.clear():
                if req.future is not None and not req.future.done():
                    req.future.set_exception(s.failure)
            return
        if s.incarnation == 0:
            if s.hello is None:
                self.send_hello(i, s, now)
            return
        if now >= s.next_heartbeat:
            s.next_heartbeat = now + self.heartbeat_interval
            self.send(s, Request(Op.HEARTBEAT, i, request_id=next(self.ids)))
        while (top := s.queue.peek()) is not None:
            req = top[1]
            heavy = req.op in MUTATING
            if (
                heavy
                and s.inflight_bytes
                and s.inflight_bytes + req.nbytes > self.max_inflight_bytes
            ):
                return
            s.queue.pop()
            if heavy:
                s.inflight_bytes += req.nbytes
            s.inflight[req.request_id] = req
            req.next_retry = now + self.retry_interval
            self.send(s, req)

    def send_now(self, s: Link, req: Request, now: float) -> bool:
        """Send ``req`` at once if nothing waits before it on ``s`` (no lane to pass
        through) and its credit allows; whether it was sent."""
        if s.queue or s.failure is not None or s.incarnation == 0:
            return False
        if req.op in MUTATING:
            if s.inflight_bytes and s.inflight_bytes + req.nbytes > self.max_inflight_bytes:
                return False
            s.inflight_bytes += req.nbytes
        s.inflight[req.request_id] = req
        req.next_retry = now + self.retry_interval
        self.send(s, req)
        return True

    def send_hello(self, i: int, s: Link, now: float) -> None:
        retry = min(self.retry_interval, self.heartbeat_interval)
        s.hello = Request(Op.HELLO, i, request_id=next(self.ids), next_retry=now + retry)
        self.send(s, s.hello)

    def send(self, s: Link, req: Request) -> None:
        req.sends += 1
        payload, meta, locator = req.payload, req.meta, None
        if s.arena is not None and req.wire is None:  # (a wire form: below the arena's size)
            try:
                payload, meta, locator = s.arena.carry(req)
            except OSError as exc:
                log.warning("shared arena with %s failed (%s); using ZeroMQ alone", s.address, exc)
                self._drop_arena(s)
        if locator is None and req.nbytes <= PACK_MAX and req.codec == "none":
            frame = small.pack_request(
                req.op,
                req.key,
                payload,
                meta,
                req.priority,
                self.worker_id,
                req.request_id,
                self.session,
                req.seq,
                s.incarnation,
                self._aux,
                self._secret,
                req.wire,
            )
            if frame is not None:
                s.drained = False  # a send may take the descriptor's signal of a message waiting
                try:
                    s.sock.send(frame, copy=True)
                except zmq.ZMQError as exc:
                    log.debug("send to %s failed (%s); will retry", s.address, exc)
                return
        header = Header(
            op=req.op,
            request_id=req.request_id,
            worker_id=self.worker_id,
            session=self.session,
            seq=req.seq,
            incarnation=s.incarnation,
            priority=req.priority,
            codec=req.codec,
            aux=self._aux,
        )
        frames = protocol.encode(
            header, req.key, payload, meta=meta, secret=self._secret, arena=locator, pack=True
        )
        s.drained = False  # a send may take the descriptor's signal of a message waiting
        try:
            frame_io.send(s.sock, frames)
        except zmq.ZMQError as exc:
            log.debug("send to %s failed (%s); will retry", s.address, exc)

    def release(self, s: Link, req: Request, *, answered: bool = True) -> None:
        """Give back ``req``'s arena segment once the server is done with it (reused
        only after an answer: a request given up may still be answered into it)."""
        if s.arena is not None:
            s.arena.release(req, answered=answered)
        req.slot = None

    def receive(self, i: int, until: _Awaited | None = None, *, ask: bool = True) -> int:
        """Handle the messages waiting from server ``i`` (at most 1000); how many.

        Ends on a receive that found nothing (``s.drained``), as ``zmq.FD``
        requires before anyone sleeps on the socket's descriptor, except when
        ``until`` is done: then it returns at once, the socket not drained (its
        caller drains it if anyone else may sleep on it). ``ask=False``: the
        descriptor just said the socket is readable; try a receive at once."""
        s = self.servers[i]
        for n in range(1000):
            # Asking first spares the zmq.Again exception, the dearest part of an empty
            # receive; zmq_poll asks for ZMQ_EVENTS for half the cost of getsockopt.
            if ask and not zmq.zmq_poll(s.poll_items, 0):
                s.drained = True
                return n
            ask = True
            try:
                frames = frame_io.receive(s.sock)
            except zmq.Again:
                s.drained = True
                return n
            s.drained = False
            if len(frames) == 1:
                ack = small.read_ack(frames[0], self._secret)
                if ack is not None and self._acked(s, *ack):
                    if until is not None and until.finished:
                        return n + 1
                    continue
            try:
                msg = protocol.decode(
                    frames,
                    secret=self._secret,
                    max_payload=1 << 40,
                    arena=None if s.arena is None else s.arena.resolve,
                )
                if not msg.header.is_reply:
                    raise ProtocolError("a request sent to a client")
            except ProtocolError as exc:
                rid = protocol.refusal_request_id(frames)
                if rid is not None and s.hello is not None and rid == s.hello.request_id:
                    self.fail_server(s, refused_error(s.address, self._secret is not None))
                    continue
                self.dropped_replies += 1
                log.warning("dropped a reply from %s: %s", s.address, exc)
                continue
            self._handle(s, msg)
            if until is not None and until.finished:
                return n + 1
        return 1000

    def fail_server(self, s: Link, exc: GradhubError) -> None:
        """Fail everything queued, in flight and kept for ``s``, and later requests to it."""
        with self.lock:
            s.failure = exc
            mine = [r for r in self.submitted if self.servers[r.server] is s]
            self.submitted = [r for r in self.submitted if self.servers[r.server] is not s]
        mine += [*s.queue.clear(), *s.inflight.values()]
        for r in mine:
            self.release(s, r, answered=False)
        s.inflight.clear()
        s.inflight_bytes = 0
        s.retained.clear()
        s.hello = None
        for r in mine:
            if r.future is not None and not r.future.done():
                r.future.set_exception(exc)

    def _handle(self, s: Link, msg: Message) -> None:
        h = msg.header
        if h.op == Op.HELLO:
            if s.hello is not None and h.request_id == s.hello.request_id:
                if h.status == Status.REFUSED:
                    self.fail_server(s, refused_error(s.address, self._secret is not None))
                else:
                    self._hello_done(s, msg)
            return
        if h.op == Op.BYE:
            self._goodbye(s, restartable=bool(h.aux))
            return
        if h.op == Op.HEARTBEAT:
            if s.incarnation and h.incarnation != s.incarnation:
                self._restart_seen(s)
            return
        req = s.inflight.get(h.request_id)
        if req is None:
            return  # an answer to a retry we already had, or to a timed-out request
        if h.status == Status.STALE_INCARNATION:
            if s.incarnation and h.incarnation != s.incarnation:
                self._restart_seen(s)
            return
        del s.inflight[h.request_id]
        if req.op in MUTATING:
            s.inflight_bytes -= req.nbytes
        try:
            self._complete(s, req, msg)
        finally:
            self.release(s, req)

    def _acked(self, s: Link, op: int, code: int, rid: int, incarnation: int, aux: int) -> bool:
        """Handle a reply read by :func:`~gradhub.ps.wire.protocol.small.read_ack` as
        :meth:`_handle` would; ``False`` (nothing done) where that needs the decoded
        message: not an OK answer to a request, or one whose reply has a callback."""
        if code != Status.OK or op in _CONTROL_OPS:
            return False
        req = s.inflight.get(rid)
        if req is None:
            return True  # an answer to a retry we already had, or to a timed-out request
        if req.on_reply is not None:
            return False
        del s.inflight[rid]
        future = req.future
        if req.op in MUTATING:
            s.inflight_bytes -= req.nbytes
            s.retain(req, aux)
        elif req.op == Op.FLUSH:
            s.prune(aux)
        if future is not None and not future.done():
            future.set_result(None)
        self.release(s, req)
        return True

    def _complete(self, s: Link, req: Request, msg: Message) -> None:
        h = msg.header
        future = req.future
        if h.status != Status.OK:
            if future is not None and not future.done():
                op = req.op.name.lower()
                future.set_exception(
                    status.error_of(h.status, msg.text(), s.address, op, req.user_key)
                )
            return
        if req.op in MUTATING:
            s.retain(req, h.aux)
        elif req.op == Op.FLUSH:
            s.prune(h.aux)
        try:
            if req.on_reply is not None:
                req.on_reply(msg)
        except Exception as exc:
            if future is not None and not future.done():
                future.set_exception(exc)
            return
        if future is not None and not future.done():
            future.set_result(None)

    def _hello_done(self, s: Link, msg: Message) -> None:
        h = msg.header
        self._start_arena(s, msg)
        restarted = s.connected_before
        s.connected_before = True
        s.incarnation = h.incarnation
        s.hello = None
        if not restarted:
            return
        s.prune(h.aux)
        log.warning(
            "parameter server %s restarted; resending %d unsaved push(es) and %d in flight",
            s.address,
            len(s.retained),
            len(s.inflight),
        )
        now = time.monotonic()
        pending = sorted([*s.retained.values(), *s.inflight.values()], key=lambda r: r.order)
        for req in pending:
            req.next_retry = now + self.retry_interval
            req.named_user = req.cancelling = False  # the old process writes nothing more
            if req.request_id not in s.inflight:
                s.inflight[req.request_id] = req
                if req.op in MUTATING:
                    s.inflight_bytes += req.nbytes
            self.send(s, req)
        s.retained.clear()

    def _goodbye(self, s: Link, *, restartable: bool) -> None:
        if restartable:
            log.warning(
                "parameter server %s is shutting down and can be restarted from its "
                "checkpoint; waiting for it (up to %gs per request)",
                s.address,
                self.timeout,
            )
            s.incarnation, s.hello = 0, None  # say hello again once it is back
            return
        self.fail_server(s, closed_error(s.address))

    def _restart_seen(self, s: Link) -> None:
        if s.hello is None:
            log.info("parameter server %s has a new incarnation; reconnecting", s.address)
            s.incarnation = 0

    def fail_all(self, exc: GradhubError) -> None:
        with self.lock:
            reqs, self.submitted = self.submitted, []
        for s in self.servers:
            reqs += list(s.inflight.values())
            reqs += s.queue.clear()
            s.inflight.clear()
        for r in reqs:
            if r.future is not None and not r.future.done():
                r.future.set_exception(exc)
