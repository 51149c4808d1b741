"""The client's I/O channel to its parameter servers: one DEALER per server.

- **Threads.** ZeroMQ sockets are not thread-safe, so they are used under one
  lock (``_io``) by whichever thread holds it: the caller of
  :meth:`Channel.submit` sends its request itself when the lock is free (with
  nothing before it, straight to the socket), and a thread waiting on its
  future (:class:`~gradhub.ps.client.pending.Pending`) receives and handles the
  replies itself, woken by the sockets' own descriptors (``zmq.FD``). So a
  request made and waited for in one thread costs one ZeroMQ round trip, with
  no hand-off to another thread. A background I/O thread does the rest:
  heartbeats, retries, deadlines, and the replies no thread is waiting for
  (it watches the sockets only while no caller does). A request submitted
  while another thread holds the lock is queued and the holder (or the I/O
  thread, woken by a pipe) sends it.
- **The protocol.** What is sent to each server and when, and what each
  answer does (credit, hello and replay, failures), is the channel's
  :class:`~gradhub.ps.client.exchange.Exchange`; what is due by the clock
  (deadlines, retries, cancels) its :class:`~gradhub.ps.client.deadlines.Deadlines`.
  The channel owns both and calls them under ``_io``.
- **Shared arena.** With a server on this host that offers one, payloads of
  at least ``arena_min_bytes`` travel through shared memory
  (:mod:`gradhub.ps.wire.arena`); the messages stay on ZeroMQ. When the arena's
  connection ends without the server's goodbye, the server process died:
  its requests fail at once with :class:`~gradhub.errors.WorkerFailedError`
  if it cannot be restarted from a checkpoint; else the channel waits for it
  as for any restart.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import secrets
import select
import threading
import time
from collections.abc import Sequence

import zmq

from gradhub.errors import ClosedError, InvalidOptionError
from gradhub.ps.client.deadlines import Deadlines
from gradhub.ps.client.exchange import Exchange
from gradhub.ps.client.link import MUTATING, Link, Request, dealer
from gradhub.ps.client.link_arenas import LinkArenas
from gradhub.ps.client.pending import Pending
from gradhub.ps.client.shared_tensors import SharedTensors

log = logging.getLogger(__name__)

_TICK = 0.05  # seconds between checks of deadlines, retries and heartbeats


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
        shared: SharedTensors | None = None,
    ) -> None:
        self.timeout = timeout
        self.arena_min_bytes = arena_min_bytes
        session = secrets.randbits(63) | 1  # this client's numbers, with worker_id and seq
        self._poll = select.poll()  # the I/O thread's
        self._arenas = LinkArenas(
            self._poll,
            self._wake,
            enabled=arena,
            min_bytes=arena_min_bytes,
            shared=shared,
            worker_id=worker_id,
            session=session,
            secret=secret,
            timeout=timeout,
        )
        self._exchange = Exchange(
            worker_id=worker_id,
            session=session,
            secret=secret,
            timeout=timeout,
            heartbeat_interval=heartbeat_interval,
            retry_interval=retry_interval,
            max_inflight_bytes=max_inflight_bytes,
            start_arena=self._arenas.start,
            drop_arena=self._arenas.drop,
        )
        self._deadlines = Deadlines(self._exchange, connect_timeout=connect_timeout)
        self._servers = self._exchange.servers  # the links, one per server
        self._lock = self._exchange.lock  # also this channel's _stopping and _drivers
        self._local = threading.local()  # each waiting thread's own poll
        self._io = threading.RLock()  # the sockets, the links and their requests
        self._pump_owner = 0  # the thread inside _pump (a callback re-entering does nothing)
        self._drivers = 0  # threads waiting on a future, watching the sockets themselves
        self._next_check = 0.0
        self._sockets_closed = False
        self._orders = itertools.count(1)
        self._stopping = False
        self._ctx = zmq.Context()
        for a in addresses:
            try:
                self._servers.append(Link(a, dealer(self._ctx, a)))
            except InvalidOptionError:
                self._close_sockets()
                raise
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
    def dropped_replies(self) -> int:
        """Replies dropped because they failed to decode or authenticate."""
        return self._exchange.dropped_replies

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self._servers]

    def submit(self, req: Request) -> Pending:
        """Queue ``req`` (its ids, sequence number and deadline are set here) and send
        it from this thread if the sockets are free."""
        payload = req.payload
        if payload is not None and req.wire is None:  # (with a wire form: checked by its maker)
            if not payload.is_cpu:
                payload, req.owned = payload.cpu(), True
            if not payload.is_contiguous():
                payload, req.owned = payload.contiguous(), True
            req.payload = payload
            req.nbytes = payload.numel() * payload.element_size()
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
            req.request_id = next(self._exchange.ids)
            req.submitted = time.monotonic()
            req.deadline = req.submitted + self.timeout
            if req.op in MUTATING:
                srv = self._servers[req.server]
                req.seq = srv.next_seq
                srv.next_seq += 1
            alone = not self._exchange.submitted  # nothing submitted before it waits to be sent
            if not alone:
                self._exchange.submitted.append(req)
        if not self._io.acquire(blocking=False):
            if alone:
                with self._lock:
                    self._exchange.submitted.append(req)
            self._wake()
            return future
        try:
            sent = alone and self._send_alone(req)
            if alone and not sent:
                with self._lock:
                    self._exchange.submitted.append(req)
            if not sent or self._exchange.submitted:  # (submitted by a callback of a reply handled)
                self._pump()
        finally:
            self._io.release()
        return future

    def _send_alone(self, req: Request) -> bool:
        """Send ``req``, which nothing submitted before it waits for, at once if its
        server is ready for it and no timer is due (the caller holds ``_io``);
        whether it was sent. Else :meth:`_pump` takes it the general way."""
        if self._pump_owner or self._sockets_closed:
            return False  # re-entered from a callback, or closing: the pump decides
        now = time.monotonic()
        s = self._servers[req.server]
        if (
            now >= self._next_check
            or now >= s.next_heartbeat
            or not self._exchange.send_now(s, req, now)
        ):
            return False
        # As _pump ends: a receive that finds nothing (the zmq.FD contract, see _receive).
        self._receive_as_pump(req.server)
        return True

    def _receive_as_pump(self, i: int, until: Pending | None = None, *, ask: bool = True) -> None:
        self._pump_owner = threading.get_ident()  # a callback that submits leaves it queued
        try:
            self._exchange.receive(i, until, ask=ask)
        finally:
            self._pump_owner = 0

    def stage(self, req: Request) -> bool | None:
        """Copy a push's payload into the shared arena of its server now, checking on
        the way whether it is finite (:meth:`ClientArena.stage`); ``None`` when it
        does not go through an arena (then nothing was done)."""
        payload = req.payload
        if payload is None or not payload.is_cpu or not payload.is_contiguous():
            return None
        nbytes = payload.numel() * payload.element_size()
        with self._io:
            s = self._servers[req.server]
            arena = s.arena
            if arena is None or nbytes < arena.min_bytes or s.failure is not None:
                return None
            req.nbytes = nbytes
            try:
                return arena.stage(req)
            except OSError:  # no segment: the request takes the usual path, which reports it
                req.slot = None
                return None

    def unstage(self, req: Request) -> None:
        """Give back the segment :meth:`stage` took for a request that is not sent."""
        with self._io:
            s = self._servers[req.server]
            if req.slot is not None and s.arena is not None:
                s.arena.give_back(req.slot, reuse=True)
            req.slot = None

    def wait(self, future: Pending, timeout: float | None) -> None:
        """Drive the sockets from this thread until ``future`` is done or ``timeout``
        seconds passed: a reply wakes this thread itself, no other thread in between."""
        if future.finished or self._pump_owner == threading.get_ident():
            return  # a callback of a reply being handled: its future cannot progress here
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        poll = self._waiters_poll()
        fds = self._zmq_fds
        with self._lock:
            self._drivers += 1
        try:
            while not future.finished and not self._stopping:
                if not self._drained():
                    # The zmq.FD contract: sleep on a socket's descriptor only after a
                    # receive that found nothing (a pump that stopped at a reply did not).
                    with self._io:
                        self._pump(future)
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                woke: list[int] = []
                for fd, _ in poll.poll(min(left, _TICK) * 1000):
                    if fd == self._kick_r:
                        with contextlib.suppress(OSError):
                            os.read(self._kick_r, 4096)
                    else:
                        woke.append(fds.index(fd))
                with self._io:
                    self._answers(future, woke)
        finally:
            with self._lock:
                self._drivers -= 1
                last = self._drivers == 0
            if not last and not self._drained():
                with self._io:
                    self._pump()  # the other waiters sleep on the descriptors
            if last and self.busy():
                self._wake()  # the I/O thread watches the sockets again

    def _answers(self, until: Pending, woke: list[int]) -> None:
        """After a poll, with ``_io``: receive from the servers that woke this thread,
        if nothing else is due; else :meth:`_pump`."""
        if (
            not woke
            or self._exchange.submitted
            or self._pump_owner
            or time.monotonic() >= self._next_check
        ):
            self._pump(until, woke)
            return
        for i in woke:
            self._receive_as_pump(i, until, ask=False)
        for s in self._servers:
            if s.queue or self._exchange.submitted:
                self._pump(until)  # submitted by a callback, or a reply gave credit back
                return

    def _drained(self) -> bool:
        """Whether every socket's last receive found nothing (see :meth:`_receive`)."""
        for s in self._servers:  # noqa: SIM110 (a loop: cheaper than all() over a generator)
            if not s.drained:
                return False
        return True

    def _waiters_poll(self) -> select.poll:
        """This thread's poll of the kick pipe and the sockets (made once per thread:
        no allocation per request)."""
        poll: select.poll | None = getattr(self._local, "poll", None)
        if poll is None:
            poll = select.poll()
            poll.register(self._kick_r, select.POLLIN)
            for fd in self._zmq_fds:
                poll.register(fd, select.POLLIN)
            self._local.poll = poll
        return poll

    def busy(self) -> bool:
        """Whether requests are queued or in flight."""
        if (
            self._exchange.submitted
        ):  # read without the lock: one who appends after wakes the I/O thread
            return True
        for s in self._servers:  # noqa: SIM110 (a loop: cheaper than any() over a generator)
            if s.inflight or s.queue:
                return True
        return False

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

    def _pump(self, until: Pending | None = None, woke: Sequence[int] = ()) -> None:
        """Send what is ready and handle every reply waiting, until nothing is left
        (the caller holds ``_io``). Ends on a receive that found nothing, as
        ``zmq.FD`` requires before anyone sleeps on it again, except when
        ``until`` is done first (then the sockets may not be drained: see
        :attr:`Link.drained`). ``woke``: the servers whose descriptor just said
        they are readable (received from without asking first)."""
        if self._pump_owner or self._sockets_closed:
            return  # re-entered from a callback: the outer pump goes on
        self._pump_owner = threading.get_ident()
        try:
            while True:
                with self._lock:
                    new, self._exchange.submitted = self._exchange.submitted, []
                now = time.monotonic()
                for req in new:
                    s = self._servers[req.server]
                    if len(new) > 1 or not self._exchange.send_now(s, req, now):
                        s.queue.push(req.key, req, req.priority)
                for i, s in enumerate(self._servers):
                    # Nothing queued, connected, no heartbeat due: _send_ready has nothing to do.
                    if s.queue or not s.incarnation or now >= s.next_heartbeat:
                        self._exchange.send_ready(i, s, now)
                if now >= self._next_check:
                    self._next_check = now + _TICK
                    self._deadlines.check_timers(now)
                received = 0
                for i in range(len(self._servers)):
                    received += self._exchange.receive(i, until, ask=i not in woke)
                    if until is not None and until.finished:
                        break
                woke = ()
                if self._exchange.submitted:
                    continue  # submitted meanwhile (by a callback or another thread)
                if not received or not any(s.queue for s in self._servers):
                    return  # else replies gave credit back: send what waited for it
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
                    elif (link := self._arenas.link_of(fd)) is not None:
                        with self._io:
                            self._arena_event(link)
        except Exception:
            log.exception("parameter-server client I/O thread failed")
            raise
        finally:
            with self._io:
                self._exchange.fail_all(ClosedError("the RemoteParameterServer was closed"))
            self._kick()

    def _kick(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._kick_w, b"x")

    def _arena_event(self, s: Link) -> None:
        arena = s.arena
        if arena is None or arena.alive():
            self._deadlines.confirmed(s)  # cancels the server confirmed
            return
        self._arenas.drop(s)
        failure = arena.ended(s.address, self.timeout)
        if failure is not None:
            self._exchange.fail_server(s, failure)
