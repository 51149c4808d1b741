"""The client's I/O channel to its parameter servers: one DEALER per server.

- **Threads.** ZeroMQ sockets are not thread-safe, so they are used under one
  lock (``_io``) by whichever thread holds it: the caller of
  :meth:`Channel.submit` sends its request itself when the lock is free, and a
  thread waiting on a request's future (:class:`Pending`) receives and handles
  the replies itself, woken by the sockets' own descriptors (``zmq.FD``). So a
  request made and waited for in one thread costs one ZeroMQ round trip, with
  no hand-off to another thread. A background I/O thread does the rest:
  heartbeats, retries, deadlines, and the replies no thread is waiting for
  (it watches the sockets only while no caller does). A request submitted
  while another thread holds the lock is queued and the holder (or the I/O
  thread, woken by a pipe) sends it.

- **Order and credit.** Per server, requests wait in
  :class:`~gradhub.ps.lanes.PriorityLanes` (one lane per key: higher priority
  first, FIFO among equals, one key's requests never reordered) and are sent
  while the pushes in flight stay under ``max_inflight_bytes``, so that a
  high-priority push can pass a queue of low-priority ones (BytePS's credit).
- **Deadlines.** Every request has a deadline (``timeout``); past it its
  future fails with :class:`~gradhub.errors.ServerTimeoutError` naming the
  server and key.
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
- **Shared arena.** With a server on this host that offers one, payloads of
  at least ``arena_min_bytes`` travel through shared memory
  (:mod:`gradhub.ps.arena`); the messages stay on ZeroMQ. When the arena's
  connection ends without the server's goodbye, the server process died:
  its requests fail at once with :class:`~gradhub.errors.WorkerFailedError`
  if it cannot be restarted from a checkpoint; else the channel waits for it
  as for any restart.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import os
import secrets
import select
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import cast

import torch
import zmq

from gradhub.errors import (
    ClosedError,
    GradhubError,
    ProtocolError,
    ServerTimeoutError,
    ServerUnavailableError,
    WorkerFailedError,
)
from gradhub.ps import protocol, status
from gradhub.ps.arena import ClientArena
from gradhub.ps.link import MUTATING, Link, Request, closed_error, refused_error
from gradhub.ps.protocol import Header, Message, Op, Status

log = logging.getLogger(__name__)

_TICK = 0.05  # seconds between checks of deadlines, retries and heartbeats
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class Pending(Future[None]):
    """The future of a request (or of several): a thread waiting on it with
    :meth:`result` or :meth:`exception` drives the channel itself until it is done."""

    def __init__(self, channel: Channel) -> None:
        super().__init__()
        self._channel = channel

    def result(self, timeout: float | None = None) -> None:
        return super().result(self._drive(timeout))

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return super().exception(self._drive(timeout))

    def _drive(self, timeout: float | None) -> float | None:
        """Drive until done or ``timeout``; the time left of ``timeout``."""
        if self.done():
            return timeout
        start = time.monotonic()
        self._channel.wait(self, timeout)
        return None if timeout is None else max(0.0, timeout - (time.monotonic() - start))


class Channel:
    """Requests to a list of servers, sent and answered by whichever thread holds
    the sockets' lock (see the module's docstring)."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        worker_id: int,
        secret: bytes | None,
        timeout: float,
        connect_timeout: float,
        heartbeat_interval: float,
        retry_interval: float,
        max_inflight_bytes: int,
        arena: bool = False,
        arena_min_bytes: int = 0,
    ) -> None:
        self.worker_id = worker_id
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self.heartbeat_interval = heartbeat_interval
        self.retry_interval = retry_interval
        self.max_inflight_bytes = max_inflight_bytes
        self.dropped_replies = 0
        self.arena = arena
        self.arena_min_bytes = arena_min_bytes
        self._arena_fds: dict[int, Link] = {}
        self._poll = select.poll()  # the I/O thread's
        self._io = threading.RLock()  # the sockets, the links and their requests
        self._pump_owner = 0  # the thread inside _pump (a callback re-entering does nothing)
        self._drivers = 0  # threads waiting on a future, watching the sockets themselves
        self._next_check = 0.0
        self._sockets_closed = False
        self._secret = secret
        self._session = secrets.randbits(63) | 1
        self._lock = threading.Lock()
        self._submitted: list[Request] = []
        self._ids = itertools.count(1)
        self._orders = itertools.count(1)
        self._stopping = False
        self._ctx = zmq.Context()
        self._servers: list[Link] = []
        for a in addresses:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.sndhwm = 0
            sock.rcvhwm = 0
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            try:
                sock.connect(a)
            except zmq.ZMQError as exc:
                sock.close(0)
                self._close_sockets()
                raise ValueError(f"cannot connect to parameter server {a!r}: {exc}") from exc
            self._servers.append(Link(a, sock))
        self._zmq_fds = [int(s.sock.getsockopt(zmq.FD)) for s in self._servers]
        self._wake_r, self._wake_w = os.pipe()  # wakes the I/O thread
        self._kick_r, self._kick_w = os.pipe()  # wakes waiting callers
        for fd in (self._wake_r, self._wake_w, self._kick_r, self._kick_w):
            os.set_blocking(fd, False)
        self._thread = threading.Thread(
            target=self._loop, name=f"gradhub-ps-client-{worker_id}", daemon=True
        )
        self._thread.start()

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self._servers]

    def submit(self, req: Request) -> Pending:
        """Queue ``req`` (its ids, sequence number and deadline are set here) and send
        it from this thread if the sockets are free."""
        if req.payload is not None and req.payload.device.type != "cpu":
            req.payload, req.owned = req.payload.cpu(), True
        if req.payload is not None and not req.payload.is_contiguous():
            req.payload, req.owned = req.payload.contiguous(), True
        if req.payload is not None:
            req.nbytes = req.payload.numel() * req.payload.element_size()
        future = Pending(self)
        req.future = future
        with self._lock:
            if self._stopping:
                raise ClosedError("this RemoteParameterServer is closed; create a new one")
            failure = self._servers[req.server].failure
            if failure is not None:
                future.set_exception(failure)
                return future
            req.order = next(self._orders)
            req.request_id = next(self._ids)
            req.submitted = time.monotonic()
            req.deadline = req.submitted + self.timeout
            if req.op in MUTATING:
                srv = self._servers[req.server]
                req.seq = srv.next_seq
                srv.next_seq += 1
            self._submitted.append(req)
        if self._io.acquire(blocking=False):
            try:
                self._pump()
            finally:
                self._io.release()
        else:
            self._wake()
        return future

    def wait(self, future: Future[None], timeout: float | None) -> None:
        """Drive the sockets from this thread until ``future`` is done or ``timeout``
        seconds passed: a reply wakes this thread itself, no other thread in between."""
        if future.done() or self._pump_owner == threading.get_ident():
            return  # a callback of a reply being handled: its future cannot progress here
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        poll = select.poll()
        poll.register(self._kick_r, select.POLLIN)
        for fd in self._zmq_fds:
            poll.register(fd, select.POLLIN)
        with self._lock:
            self._drivers += 1
        try:
            # Every pump ends by asking the sockets for messages (the zmq.FD contract),
            # so this thread may sleep on their descriptors right away.
            while not future.done() and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                for fd, _ in poll.poll(min(left, _TICK) * 1000):
                    if fd == self._kick_r:
                        with contextlib.suppress(OSError):
                            os.read(self._kick_r, 4096)
                with self._io:
                    self._pump()
        finally:
            with self._lock:
                self._drivers -= 1
                last = self._drivers == 0
            if last and self.busy():
                self._wake()  # the I/O thread watches the sockets again

    def busy(self) -> bool:
        """Whether requests are queued or in flight."""
        with self._lock:
            if self._submitted:
                return True
        return any(s.inflight or s.queue for s in self._servers)

    def unsaved(self) -> list[int]:
        """The servers holding pushes they acknowledged but have not yet put on disk."""
        return [i for i, s in enumerate(self._servers) if s.retained]

    def close(self) -> None:
        """Stop the I/O thread (pending futures fail with ``ClosedError``) and the sockets."""
        with self._lock:
            self._stopping = True
        self._wake()
        self._thread.join()
        with self._io:
            self._close_sockets()
        for fd in (self._wake_r, self._wake_w, self._kick_r, self._kick_w):
            os.close(fd)

    def arena_in_use(self, server: int) -> bool:
        """Whether payloads to ``server`` go through a shared arena now."""
        return self._servers[server].arena is not None

    # --------------------------------------------------------------- helpers
    def _close_sockets(self) -> None:
        self._sockets_closed = True
        for s in self._servers:
            if s.arena is not None:
                s.arena.close()
                s.arena = None
            s.sock.close(0)
        self._ctx.term()

    def _wake(self) -> None:
        # A full pipe already wakes the loop; a closed one means we are stopping.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _pump(self) -> None:
        """Send what is ready and handle every reply waiting, until nothing is left
        (the caller holds ``_io``). Ends on a receive that found nothing, as
        ``zmq.FD`` requires before anyone sleeps on it again."""
        if self._pump_owner or self._sockets_closed:
            return  # re-entered from a callback: the outer pump goes on
        self._pump_owner = threading.get_ident()
        try:
            while True:
                with self._lock:
                    new, self._submitted = self._submitted, []
                for req in new:
                    self._servers[req.server].queue.push(req.key, req, req.priority)
                now = time.monotonic()
                for i, s in enumerate(self._servers):
                    self._send_ready(i, s, now)
                if now >= self._next_check:
                    self._next_check = now + _TICK
                    self._check_timers(now)
                received = sum(self._receive(i) for i in range(len(self._servers)))
                if not received and not self._submitted:
                    return
        finally:
            self._pump_owner = 0

    # ----------------------------------------------------------- I/O thread
    def _loop(self) -> None:
        poll = self._poll
        poll.register(self._wake_r, select.POLLIN)
        watching = False
        try:
            while True:
                with self._io:
                    if self._stopping:
                        break
                    self._pump()
                with self._lock:
                    drivers = self._drivers
                if drivers:
                    self._kick()  # a future this thread completed may have a waiter
                if watching != (drivers == 0):
                    watching = drivers == 0  # the sockets: watched here only while no caller does
                    for fd in self._zmq_fds:
                        if watching:
                            poll.register(fd, select.POLLIN)
                        else:
                            poll.unregister(fd)
                for fd, _ in poll.poll(_TICK * 1000):
                    if fd == self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                    elif fd in self._arena_fds:
                        with self._io:
                            self._arena_event(self._arena_fds[fd])
        except Exception:
            log.exception("parameter-server client I/O thread failed")
            raise
        finally:
            with self._io:
                self._fail_all(ClosedError("the RemoteParameterServer was closed"))
            self._kick()

    def _kick(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._kick_w, b"x")

    def _send_ready(self, i: int, s: Link, now: float) -> None:
        if s.failure is not None:
            for req in s.queue.clear():
                if req.future is not None and not req.future.done():
                    req.future.set_exception(s.failure)
            return
        if s.incarnation == 0:
            if s.hello is None:
                self._send_hello(i, s, now)
            return
        if now >= s.next_heartbeat:
            s.next_heartbeat = now + self.heartbeat_interval
            self._send(s, Request(Op.HEARTBEAT, i, request_id=next(self._ids)))
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
            self._send(s, req)

    def _send_hello(self, i: int, s: Link, now: float) -> None:
        retry = min(self.retry_interval, self.heartbeat_interval)
        s.hello = Request(Op.HELLO, i, request_id=next(self._ids), next_retry=now + retry)
        self._send(s, s.hello)

    def _send(self, s: Link, req: Request) -> None:
        req.sends += 1
        payload, meta, locator = req.payload, req.meta, None
        if s.arena is not None:
            try:
                payload, meta, locator = self._through_arena(s.arena, req)
            except OSError as exc:
                log.warning("shared arena with %s failed (%s); using ZeroMQ alone", s.address, exc)
                self._drop_arena(s)
        header = Header(
            op=req.op,
            request_id=req.request_id,
            worker_id=self.worker_id,
            session=self._session,
            seq=req.seq,
            incarnation=s.incarnation,
            priority=req.priority,
            codec=req.codec,
            aux=int(self.timeout * 1000),  # how long the server may hold it
        )
        frames = protocol.encode(
            header, req.key, payload, meta=meta, secret=self._secret, arena=locator
        )
        try:
            s.sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:
            log.debug("send to %s failed (%s); will retry", s.address, exc)

    def _through_arena(
        self, arena: ClientArena, req: Request
    ) -> tuple[torch.Tensor | None, bytes, bytes | None]:
        """(payload, meta, locator) of ``req`` through ``arena``: a push's tensor is
        copied into a segment (once: a retry finds it there); a pull names the
        segment its reply goes into. Small requests pass unchanged."""
        if req.slot is not None and not arena.holds(req.slot):
            req.slot = None  # lent by an arena that is gone
        if req.payload is not None and req.nbytes >= arena.min_bytes and req.op in MUTATING:
            if req.slot is None:
                req.slot = arena.take(req.nbytes)
                req.slot.tensor(req.payload).copy_(req.payload)
            return req.slot.tensor(req.payload), req.meta, req.slot.locator(req.nbytes)
        if req.op == Op.PULL and req.reply_bytes >= arena.min_bytes:
            if req.slot is None:
                req.slot = arena.take(req.reply_bytes)
            where = {"arena": [req.slot.id, 0, req.reply_bytes]}
            return None, json.dumps(where).encode(), None
        return req.payload, req.meta, None

    def _release(self, s: Link, req: Request) -> None:
        """Give back ``req``'s arena segment once the server is done with it."""
        if req.slot is not None:
            if s.arena is not None:
                s.arena.give_back(req.slot, reuse=req.sends == 1)
            req.slot = None

    def _start_arena(self, s: Link, msg: Message) -> None:
        """Connect the shared arena a hello reply offers, if this host is the server's."""
        self._drop_arena(s)
        if not self.arena or not msg.payload:
            return
        try:
            info = json.loads(msg.text())
            if not isinstance(info, dict) or not ClientArena.offered(info):
                return
            arena = ClientArena(
                info,
                session=self._session,
                worker_id=self.worker_id,
                secret=self._secret,
                timeout=self.timeout,
                min_bytes=self.arena_min_bytes,
            )
        except (OSError, ValueError) as exc:
            log.info("no shared arena with %s: %s", s.address, exc)
            return
        s.arena = arena
        self._arena_fds[arena.fileno()] = s
        self._poll.register(arena.fileno(), select.POLLIN)
        self._wake()  # the I/O thread watches it from its next poll
        log.debug("shared arena with %s (pid %d)", s.address, arena.server_pid)

    def _drop_arena(self, s: Link) -> None:
        if s.arena is None:
            return
        fd = s.arena.fileno()
        self._arena_fds.pop(fd, None)
        with contextlib.suppress(KeyError):
            self._poll.unregister(fd)
        s.arena.close()
        s.arena = None

    def _arena_event(self, s: Link) -> None:
        arena = s.arena
        if arena is None or arena.alive():
            return
        self._drop_arena(s)
        if arena.said_bye:
            return  # the server closed: its goodbye on ZeroMQ says what follows
        if arena.restartable:
            log.warning(
                "parameter server %s (pid %d) died; waiting for it to restart from its "
                "checkpoint (up to %gs per request)",
                s.address,
                arena.server_pid,
                self.timeout,
            )
            return
        self._fail_server(
            s,
            WorkerFailedError(
                f"parameter server {s.address} (pid {arena.server_pid}) died: its process "
                "ended without closing, and it keeps no checkpoint to restart from"
            ),
        )

    def _receive(self, i: int) -> int:
        """Handle the messages waiting from server ``i`` (at most 1000); how many."""
        s = self._servers[i]
        for n in range(1000):
            # Asking first spares the zmq.Again exception, the dearest part of an empty receive.
            if not cast(int, s.sock.getsockopt(_EVENTS)) & _POLLIN:
                return n
            try:
                frames = s.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return n
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
                    self._fail_server(s, refused_error(s.address, self._secret is not None))
                    continue
                self.dropped_replies += 1
                log.warning("dropped a reply from %s: %s", s.address, exc)
                continue
            self._handle(s, msg)
        return 1000

    def _fail_server(self, s: Link, exc: GradhubError) -> None:
        """Fail everything queued, in flight and kept for ``s``, and later requests to it."""
        with self._lock:
            s.failure = exc
            mine = [r for r in self._submitted if self._servers[r.server] is s]
            self._submitted = [r for r in self._submitted if self._servers[r.server] is not s]
        mine += [*s.queue.clear(), *s.inflight.values()]
        for r in mine:
            self._release(s, r)
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
                    self._fail_server(s, refused_error(s.address, self._secret is not None))
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
            self._release(s, req)

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
            if req.request_id not in s.inflight:
                s.inflight[req.request_id] = req
                if req.op in MUTATING:
                    s.inflight_bytes += req.nbytes
            self._send(s, req)
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
        self._fail_server(s, closed_error(s.address))

    def _restart_seen(self, s: Link) -> None:
        if s.hello is None:
            log.info("parameter server %s has a new incarnation; reconnecting", s.address)
            s.incarnation = 0

    def _check_timers(self, now: float) -> None:
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
                self._send_hello(i, s, now)
            for rid, req in list(s.inflight.items()):
                if now >= req.deadline:
                    del s.inflight[rid]
                    if req.op in MUTATING:
                        s.inflight_bytes -= req.nbytes
                    self._expire(s, req)
                elif now >= req.next_retry and s.incarnation:
                    req.next_retry = now + self.retry_interval
                    self._send(s, req)
            for req in s.queue.remove_if(lambda r: now >= r.deadline):
                self._expire(s, req)

    def _expire(self, s: Link, req: Request) -> None:
        self._release(s, req)
        if req.future is not None and not req.future.done():
            op = req.op.name.lower()
            req.future.set_exception(
                ServerTimeoutError(s.address, req.user_key or None, op, self.timeout)
            )

    def _fail_all(self, exc: GradhubError) -> None:
        with self._lock:
            reqs, self._submitted = self._submitted, []
        for s in self._servers:
            reqs += list(s.inflight.values())
            reqs += s.queue.clear()
            s.inflight.clear()
        for r in reqs:
            if r.future is not None and not r.future.done():
                r.future.set_exception(exc)
