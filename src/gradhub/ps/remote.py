"""RemoteParameterServer: the ParameterServer interface over ZeroMQ.

One I/O thread owns one DEALER socket per server (ZeroMQ sockets are not
thread-safe); callers hand it requests through a locked list and a wake-up
pipe. It returns futures from :meth:`push` and :meth:`pull`.

How work is spread and ordered:
- A key lives on server ``crc32(key) % len(addresses)``. A tensor larger than
  ``slice_bytes`` is cut into ``len(addresses)`` slices (BigDL's partition
  math on the flattened tensor), slice ``i`` on server ``(home + i) % n``
  under the key ``"<key>[slice i/n]"``. The layout depends only on the key,
  the tensor's byte size, the address list and ``slice_bytes``: every worker
  must use the same address list and threshold.
- Per server, requests wait in a priority queue (higher first, FIFO among
  equals; a request never overtakes an earlier one of the same key, which
  inherits its priority) and are sent while the pushes in flight stay under
  ``max_inflight_bytes``, so that a high-priority push can pass a queue of
  low-priority ones (BytePS's credit idea).

Steps for sync/ssp servers: a worker's step on a key is the number of pushes
it has made to that key; nothing else is needed. In sync mode a pull returns
once the rounds of the worker's pushes are applied; in ssp mode a pull waits
while the worker is more than ``max_staleness`` pushes ahead of the slowest
live worker. Workers stay live by heartbeats (every ``heartbeat_interval``).

Failures:
- Every request has a deadline (``timeout``); past it the future fails with
  :class:`~gradhub.errors.ServerTimeoutError` naming the server and key.
- Pushes and inits carry ``(worker_id, session, seq)``; a request not answered
  within ``retry_interval`` is sent again with the same numbers, and the
  server applies it once.
- After a server restart (a new *incarnation*, noticed on a heartbeat or a
  ``STALE_INCARNATION`` answer) the client says hello again and resends, in
  their original order, the pushes the server had acknowledged but not yet
  checkpointed (kept until the server reports them durable), then everything
  in flight. ZeroMQ reconnects the socket on its own.
- Decision: a push sends the caller's gradient memory without a copy (one
  replica, no codec): do not modify it until the future is done.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import logging
import os
import secrets
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from gradhub import codecs
from gradhub.errors import (
    ClosedError,
    DuplicateParameterError,
    GradhubError,
    ProtocolError,
    ServerTimeoutError,
    ShapeMismatchError,
    UnknownParameterError,
)
from gradhub.partition import partition_ranges
from gradhub.ps import protocol
from gradhub.ps.base import ParameterServer, Replicas, as_replicas
from gradhub.ps.config import secret_bytes
from gradhub.ps.protocol import Header, Message, Op, Status

log = logging.getLogger(__name__)

DEFAULT_SLICE_BYTES = 4 << 20


def server_index(key: str, num_servers: int) -> int:
    """The server that holds ``key`` (stable across processes and runs)."""
    return zlib.crc32(key.encode("utf-8")) % num_servers


@dataclass
class _Request:
    op: Op
    server: int
    key: str  # the key on the wire (a slice key for slices)
    user_key: str
    priority: int
    order: int
    request_id: int
    seq: int = 0
    payload: torch.Tensor | None = None
    owned: bool = False  # payload is our own copy (may be kept for replay as is)
    codec: str = "none"
    on_reply: Callable[[Message], None] | None = None
    future: Future[None] | None = None
    deadline: float = float("inf")
    next_retry: float = float("inf")
    nbytes: int = 0


@dataclass
class _Server:
    address: str
    sock: zmq.Socket[Any]
    incarnation: int = 0
    connected_before: bool = False
    hello: _Request | None = None
    next_seq: int = 1
    heap: list[tuple[int, int, str]] = field(default_factory=list)
    lanes: dict[str, list[_Request]] = field(default_factory=dict)
    inflight: dict[int, _Request] = field(default_factory=dict)
    inflight_bytes: int = 0
    retained: dict[int, _Request] = field(default_factory=dict)  # acked, not yet durable
    next_heartbeat: float = 0.0


class RemoteParameterServer(ParameterServer):
    """A client of one or more ``gradhub serve`` processes.

    Args:
        addresses: one ZeroMQ endpoint or a list (``tcp://host:port``).
        worker_id: this worker's id (unique in the job; sync/ssp count workers by it).
        secret: shared secret (str or bytes) when the servers require one.
        timeout: seconds any request may take before ``ServerTimeoutError``.
        codec: wire codec for gradients (``"none"``, ``"fp16"``, ``"bf16"``, ...);
            values always travel exactly.
        slice_bytes: tensors above this many bytes are sliced over all servers.
        heartbeat_interval: seconds between heartbeats to each server.
        retry_interval: seconds before an unanswered request is sent again.
        max_inflight_bytes: push bytes in flight per server before queueing.
    """

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        worker_id: int,
        secret: str | bytes | None = None,
        timeout: float = 60.0,
        codec: str = "none",
        slice_bytes: int = DEFAULT_SLICE_BYTES,
        heartbeat_interval: float = 1.0,
        retry_interval: float = 5.0,
        max_inflight_bytes: int = 64 << 20,
    ) -> None:
        addrs = [addresses] if isinstance(addresses, str) else list(addresses)
        if not addrs:
            raise ValueError("give at least one parameter-server address")
        if not 0 <= worker_id < 2**32:
            raise ValueError(f"worker_id must be in [0, 2**32), got {worker_id}")
        if not timeout > 0 or not heartbeat_interval > 0 or not retry_interval > 0:
            raise ValueError("timeout, heartbeat_interval and retry_interval must be positive")
        self.addresses = addrs
        self.worker_id = worker_id
        self.timeout = float(timeout)
        self.codec = codecs.get(codec)
        self.slice_bytes = int(slice_bytes)
        self.heartbeat_interval = float(heartbeat_interval)
        self.retry_interval = float(retry_interval)
        self.max_inflight_bytes = int(max_inflight_bytes)
        self._secret = secret_bytes(secret)
        self._session = secrets.randbits(63) | 1
        self._lock = threading.Lock()
        self._submitted: list[_Request] = []
        self._ids = itertools.count(1)
        self._orders = itertools.count(1)
        self._closed = False
        self._stopping = False
        self.dropped_replies = 0
        self._ctx = zmq.Context()
        self._servers: list[_Server] = []
        for a in addrs:
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
            self._servers.append(_Server(a, sock))
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._thread = threading.Thread(
            target=self._loop, name=f"gradhub-ps-client-{worker_id}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------ public API
    def init(self, key: str, values: Replicas) -> None:
        """Store the initial value of ``key`` on its server(s); blocks until acknowledged."""
        self._check_open()
        value = as_replicas(values)[0].detach()
        futures = [
            self._submit(Op.INIT, key, slice_key, srv, 0, payload=part, owned=False)
            for slice_key, srv, part in self._pieces(key, value)
        ]
        for f in futures:
            f.result()

    def push(self, key: str, grads: Replicas, priority: int = 0) -> Future[None]:
        """Send the sum of ``grads``; the future is done once the server accepted it."""
        self._check_open()
        reps = [g.detach() for g in as_replicas(grads, what="grads")]
        total = reps[0]
        owned = len(reps) > 1
        if owned:
            total = torch.stack([r.to("cpu") for r in reps]).sum(0)
        codec = self.codec.name if total.is_floating_point() else "none"
        futures = []
        for slice_key, srv, part in self._pieces(key, total):
            part_owned = owned
            if codec != "none":
                part, part_owned = self.codec.encode(part), True
            futures.append(
                self._submit(
                    Op.PUSH,
                    key,
                    slice_key,
                    srv,
                    priority,
                    payload=part,
                    owned=part_owned,
                    codec=codec,
                )
            )
        return _all_of(futures)

    def pull(self, key: str, weights: Replicas, priority: int = 0) -> Future[None]:
        """Copy the value of ``key`` into every tensor of ``weights``."""
        self._check_open()
        targets = as_replicas(weights, what="weights")
        first = targets[0]
        futures = []
        pieces = self._layout(key, first.numel() * first.element_size(), first.numel())
        for slice_key, srv, rng in pieces:
            futures.append(
                self._submit(
                    Op.PULL,
                    key,
                    slice_key,
                    srv,
                    priority,
                    on_reply=_filler(key, targets, rng),
                )
            )
        return _all_of(futures)

    def stats(self) -> list[dict[str, Any]]:
        """Each server's counters and accounting (blocks up to ``timeout``)."""
        self._check_open()
        out: list[dict[str, Any]] = []
        for i in range(len(self._servers)):
            box: list[dict[str, Any]] = []

            def keep(msg: Message, box: list[dict[str, Any]] = box) -> None:
                box.append(json.loads(msg.text()))

            self._submit(Op.STATS, "", "", i, 0, on_reply=keep).result()
            out.append(box[0])
        return out

    def shutdown_servers(self) -> None:
        """Ask every server to checkpoint and exit."""
        self._check_open()
        futures = [self._submit(Op.SHUTDOWN, "", "", i, 0) for i in range(len(self._servers))]
        for f in futures:
            f.result()

    def close(self, timeout: float | None = 10.0) -> None:
        """Wait (up to ``timeout``) for requests in flight, then stop; idempotent."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while time.monotonic() < deadline and self._busy():
            time.sleep(0.005)
        with self._lock:
            self._stopping = True
        self._wake()
        self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._close_sockets()

    def __enter__(self) -> RemoteParameterServer:
        return self

    # --------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this RemoteParameterServer is closed; create a new one")

    def _close_sockets(self) -> None:
        for s in self._servers:
            s.sock.close(0)
        self._ctx.term()

    def _busy(self) -> bool:
        with self._lock:
            if self._submitted:
                return True
        return any(s.inflight or s.lanes for s in self._servers)

    def _layout(self, key: str, nbytes: int, numel: int) -> list[tuple[str, int, slice | None]]:
        n = len(self._servers)
        home = server_index(key, n)
        if n == 1 or nbytes <= self.slice_bytes or numel < n:
            return [(key, home, None)]
        return [
            (f"{key}[slice {i}/{n}]", (home + i) % n, slice(start, start + length))
            for i, (start, length) in enumerate(partition_ranges(numel, n))
        ]

    def _pieces(self, key: str, tensor: torch.Tensor) -> list[tuple[str, int, torch.Tensor]]:
        pieces = self._layout(key, tensor.numel() * tensor.element_size(), tensor.numel())
        if pieces[0][2] is None:
            return [(pieces[0][0], pieces[0][1], tensor)]
        flat = tensor.reshape(-1)
        return [(k, srv, flat[rng]) for k, srv, rng in pieces]

    def _submit(
        self,
        op: Op,
        user_key: str,
        key: str,
        server: int,
        priority: int,
        *,
        payload: torch.Tensor | None = None,
        owned: bool = False,
        codec: str = "none",
        on_reply: Callable[[Message], None] | None = None,
    ) -> Future[None]:
        if payload is not None and payload.device.type != "cpu":
            payload, owned = payload.cpu(), True
        if payload is not None and not payload.is_contiguous():
            payload, owned = payload.contiguous(), True
        future: Future[None] = Future()
        req = _Request(
            op=op,
            server=server,
            key=key,
            user_key=user_key,
            priority=int(priority),
            order=0,
            request_id=0,
            payload=payload,
            owned=owned,
            codec=codec,
            on_reply=on_reply,
            future=future,
            nbytes=0 if payload is None else payload.numel() * payload.element_size(),
        )
        with self._lock:
            if self._stopping:
                raise ClosedError("this RemoteParameterServer is closed; create a new one")
            req.order = next(self._orders)
            req.request_id = next(self._ids)
            req.deadline = time.monotonic() + self.timeout
            if op in (Op.INIT, Op.PUSH):
                srv = self._servers[server]
                req.seq = srv.next_seq
                srv.next_seq += 1
            self._submitted.append(req)
        self._wake()
        return future

    def _wake(self) -> None:
        # A full pipe already wakes the loop; a closed one means we are stopping.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    # ----------------------------------------------------------- I/O thread
    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        for s in self._servers:
            poller.register(s.sock, zmq.POLLIN)
        socks = {s.sock: i for i, s in enumerate(self._servers)}
        next_check = 0.0
        try:
            while True:
                with self._lock:
                    new, self._submitted = self._submitted, []
                    stopping = self._stopping
                if stopping:
                    break
                for req in new:
                    self._enqueue(req)
                now = time.monotonic()
                for i, s in enumerate(self._servers):
                    self._send_ready(i, s, now)
                if now >= next_check:
                    next_check = now + 0.05
                    self._check_timers(now)
                for sock, _ in poller.poll(50):
                    if sock == self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                    else:
                        self._receive(socks[sock])
        except Exception:
            log.exception("parameter-server client I/O thread failed")
            raise
        finally:
            self._fail_all(ClosedError("the RemoteParameterServer was closed"))

    def _enqueue(self, req: _Request) -> None:
        s = self._servers[req.server]
        lane = s.lanes.setdefault(req.key, [])
        lane.append(req)
        heapq.heappush(s.heap, (-req.priority, req.order, req.key))

    def _next_in_order(self, s: _Server) -> _Request | None:
        while s.heap:
            _, order, key = s.heap[0]
            lane = s.lanes.get(key)
            if not lane or all(r.order != order for r in lane):
                heapq.heappop(s.heap)  # already sent with an earlier entry of its lane
                continue
            return lane[0]
        return None

    def _send_ready(self, i: int, s: _Server, now: float) -> None:
        if s.incarnation == 0:
            if s.hello is None:
                self._send_hello(i, s, now)
            return
        if now >= s.next_heartbeat:
            s.next_heartbeat = now + self.heartbeat_interval
            hb = _Request(Op.HEARTBEAT, i, "", "", 0, 0, next(self._ids))
            self._send(s, hb)
        while True:
            req = self._next_in_order(s)
            if req is None:
                return
            heavy = req.op in (Op.PUSH, Op.INIT)
            if (
                heavy
                and s.inflight_bytes
                and s.inflight_bytes + req.nbytes > self.max_inflight_bytes
            ):
                return
            s.lanes[req.key].pop(0)
            if not s.lanes[req.key]:
                del s.lanes[req.key]
            if heavy:
                s.inflight_bytes += req.nbytes
            s.inflight[req.request_id] = req
            req.next_retry = now + self.retry_interval
            self._send(s, req)

    def _send_hello(self, i: int, s: _Server, now: float) -> None:
        with self._lock:
            rid = next(self._ids)
        retry = min(self.retry_interval, self.heartbeat_interval)
        s.hello = _Request(Op.HELLO, i, "", "", 0, 0, rid, next_retry=now + retry)
        self._send(s, s.hello)

    def _send(self, s: _Server, req: _Request) -> None:
        header = Header(
            op=req.op,
            request_id=req.request_id,
            worker_id=self.worker_id,
            session=self._session,
            seq=req.seq,
            incarnation=s.incarnation,
            priority=req.priority,
            codec=req.codec,
        )
        frames = protocol.encode(header, req.key, req.payload, secret=self._secret)
        try:
            s.sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:
            log.debug("send to %s failed (%s); will retry", s.address, exc)

    def _receive(self, i: int) -> None:
        s = self._servers[i]
        for _ in range(1000):
            try:
                frames = s.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = protocol.decode(frames, secret=self._secret, max_payload=1 << 40)
                if not msg.header.is_reply:
                    raise ProtocolError("a request sent to a client")
            except ProtocolError as exc:
                self.dropped_replies += 1
                log.warning("dropped a reply from %s: %s", s.address, exc)
                continue
            self._handle(i, s, msg)

    def _handle(self, i: int, s: _Server, msg: Message) -> None:
        h = msg.header
        if h.op == Op.HELLO:
            if s.hello is not None and h.request_id == s.hello.request_id:
                self._hello_done(s, h)
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
        if req.op in (Op.PUSH, Op.INIT):
            s.inflight_bytes -= req.nbytes
        future = req.future
        if h.status != Status.OK:
            if future is not None and not future.done():
                future.set_exception(_remote_error(h.status, msg.text(), s.address, req))
            return
        if req.op in (Op.PUSH, Op.INIT):
            self._retain(s, req, h.aux)
        try:
            if req.on_reply is not None:
                req.on_reply(msg)
        except Exception as exc:
            if future is not None and not future.done():
                future.set_exception(exc)
            return
        if future is not None and not future.done():
            future.set_result(None)

    def _retain(self, s: _Server, req: _Request, durable: int) -> None:
        for seq in [q for q in s.retained if q <= durable]:
            del s.retained[seq]
        if req.seq > durable:
            if not req.owned and req.payload is not None:
                req.payload, req.owned = req.payload.clone(), True
            req.future, req.on_reply, req.deadline = None, None, float("inf")
            s.retained[req.seq] = req

    def _hello_done(self, s: _Server, h: Header) -> None:
        restarted = s.connected_before
        s.connected_before = True
        s.incarnation = h.incarnation
        s.hello = None
        if not restarted:
            return
        for seq in [q for q in s.retained if q <= h.aux]:
            del s.retained[seq]
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
                if req.op in (Op.PUSH, Op.INIT):
                    s.inflight_bytes += req.nbytes
            self._send(s, req)
        s.retained.clear()

    def _restart_seen(self, s: _Server) -> None:
        if s.hello is None:
            log.info("parameter server %s has a new incarnation; reconnecting", s.address)
            s.incarnation = 0

    def _check_timers(self, now: float) -> None:
        for i, s in enumerate(self._servers):
            if s.hello is not None and now >= s.hello.next_retry:
                self._send_hello(i, s, now)
            for rid, req in list(s.inflight.items()):
                if now >= req.deadline:
                    del s.inflight[rid]
                    if req.op in (Op.PUSH, Op.INIT):
                        s.inflight_bytes -= req.nbytes
                    self._expire(s, req)
                elif now >= req.next_retry and s.incarnation:
                    req.next_retry = now + self.retry_interval
                    self._send(s, req)
            for key, lane in list(s.lanes.items()):
                keep = [r for r in lane if now < r.deadline]
                for r in lane:
                    if now >= r.deadline:
                        self._expire(s, r)
                if keep:
                    s.lanes[key] = keep
                else:
                    del s.lanes[key]

    def _expire(self, s: _Server, req: _Request) -> None:
        if req.future is not None and not req.future.done():
            op = req.op.name.lower()
            req.future.set_exception(
                ServerTimeoutError(s.address, req.user_key or None, op, self.timeout)
            )

    def _fail_all(self, exc: GradhubError) -> None:
        with self._lock:
            leftover, self._submitted = self._submitted, []
        reqs = list(leftover)
        for s in self._servers:
            reqs += list(s.inflight.values())
            for lane in s.lanes.values():
                reqs += lane
            s.inflight.clear()
            s.lanes.clear()
            s.heap.clear()
        for r in reqs:
            if r.future is not None and not r.future.done():
                r.future.set_exception(exc)


def _filler(key: str, targets: list[torch.Tensor], rng: slice | None) -> Callable[[Message], None]:
    def fill(msg: Message) -> None:
        value = msg.tensor()
        first = targets[0]
        if rng is None:
            if value.shape != first.shape:
                raise ShapeMismatchError(f"[{key!r}]", list(value.shape), list(first.shape))
            if value.dtype != first.dtype:
                raise ShapeMismatchError(f"[{key!r}]", value.dtype, first.dtype, "dtype")
        elif value.numel() != rng.stop - rng.start or value.dtype != first.dtype:
            raise ShapeMismatchError(
                f"[{key!r}]", f"{value.numel()} x {value.dtype}", f"{first.numel()} x {first.dtype}"
            )
        with torch.no_grad():
            for t in targets:
                if rng is None:
                    t.copy_(value)
                elif t.is_contiguous():
                    t.view(-1)[rng].copy_(value)
                else:
                    flat = t.reshape(-1).clone()
                    flat[rng].copy_(value)
                    t.copy_(flat.view(t.shape))

    return fill


def _remote_error(status: Status, text: str, address: str, req: _Request) -> Exception:
    where = f" (server {address})"
    if status == Status.UNKNOWN_KEY:
        return UnknownParameterError(
            f"unknown parameter key {req.user_key!r}{where}; call init({req.user_key!r}, ...) first"
        )
    if status == Status.DUPLICATE_KEY:
        return DuplicateParameterError(text + where)
    if status == Status.SHAPE_MISMATCH:
        err = ShapeMismatchError(f"[{req.user_key!r}]", "the stored shape", "another", "shape")
        err.args = (text + where,)
        return err
    if status == Status.BAD_REQUEST:
        return ValueError(text + where)
    return GradhubError(f"{req.op.name.lower()} of {req.user_key!r} failed on {address}: {text}")


def _all_of(futures: list[Future[None]]) -> Future[None]:
    """A future done when all of ``futures`` are; it fails with the first failure."""
    if len(futures) == 1:
        return futures[0]
    out: Future[None] = Future()
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
