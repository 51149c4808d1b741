"""The parameter-server process: a ROUTER socket in front of the
:class:`~gradhub.ps.server.service.Service` it owns (the service answers
through the server's :meth:`~Server._reply`).

One thread runs the loop: it drains every message waiting on the socket,
queues data operations (init, push, pull) by priority, runs them, answers
control operations (hello, heartbeat, stats, flush, shutdown, a surviving
job's membership) at once, expires silent workers and writes checkpoints.
Being single-threaded, it needs no locks and its checkpoints are consistent
by construction.

Decisions:
- Every reply carries the server's *incarnation* (random per start); a data
  request naming another incarnation is answered ``STALE_INCARNATION`` so the
  client says hello again and replays before anything else is served.
- A ``FLUSH`` request is answered after the requests drained with it ran and a
  checkpoint holds them (a durable server: once its log is synced).
- Durable servers (:mod:`gradhub.ps.server.wal`): the acknowledgements of inits and
  pushes are held until the log is synced, once per batch of requests drained
  from the socket (group commit).
- On the way out the server tells every client it heard from (``BYE``):
  whether it can be restarted from a checkpoint (clients wait for it) or not
  (their calls fail at once with ``ClosedError``).
- ``SHUTDOWN`` is obeyed only from a worker (and session) that said hello to
  this incarnation; any other is refused with a log line (a stale incarnation
  with ``STALE_INCARNATION``, so a real client says hello and resends) and the
  server serves on. A wait that times out names the worker ids it waits for
  (:meth:`~gradhub.ps.server.consistency.Consistency.waiting_for`).
- Messages it cannot accept: see :mod:`gradhub.ps.server.rejects`.
- Clients on this host get a shared arena for their payloads
  (:mod:`gradhub.ps.wire.arena`; ``config.arena``): the hello reply says where, a
  push is read where it lies, a pull is copied into the segment it names.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from typing import Any

import torch
import zmq

from gradhub.errors import ProtocolError
from gradhub.ps.server.arenas import ServerArenas
from gradhub.ps.server.config import ServerConfig, default_optimizer
from gradhub.ps.server.rejects import Rejects
from gradhub.ps.server.service import Service
from gradhub.ps.server.store import describe
from gradhub.ps.wire import arena, protocol, zmq_errors
from gradhub.ps.wire import frames as frame_io
from gradhub.ps.wire.protocol import MUTATING, Message, Op, Status, small

log = logging.getLogger(__name__)

_DATA_OPS = (Op.INIT, Op.PUSH, Op.PULL, Op.STATE, Op.SET_STATE)
_POLL_MS = 100


class Server:
    """A parameter server bound to ``config.bind``; :meth:`serve` runs its loop.

    The socket is bound in the constructor, so :attr:`address` is known before
    serving starts (``*`` ports resolved).
    """

    def __init__(self, config: ServerConfig):
        self.config = config
        self.incarnation = secrets.randbits(63) | 1
        self._arenas: ServerArenas | None = None
        self.service = Service(
            config, incarnation=self.incarnation, reply=self._reply, copies_out=self._copies_out
        )
        self.counters = self.service.counters
        self.persist = self.service.persist
        self._peers: set[bytes] = set()  # connections to say goodbye to
        self._greeted: set[tuple[int, int]] = set()  # (worker, session) that said hello
        self.rejects = Rejects(self.counters)
        self._stop = threading.Event()
        self._closed = False
        self._flushes: list[Message] = []
        self._held: list[list[Any]] = []  # replies waiting for the log's sync
        self.counters.update(arena_payloads=0, arena_replies=0, arena_shared_replies=0)
        self.service.restore()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.setsockopt(zmq.MAXMSGSIZE, config.max_payload + protocol.HEADER_SIZE + 4096)
        self._sock.sndhwm = 0
        self._sock.rcvhwm = 0
        try:
            self._sock.bind(config.bind)
        except zmq.ZMQError as exc:
            self._sock.close(0)
            self._ctx.term()
            raise zmq_errors.translate(exc, endpoint=config.bind, action="bind") from exc
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.service.address = self.address
        self._poll_items: list[tuple[Any, int]] = [(self._sock, zmq.POLLIN)]
        self._hello_info = b""
        if config.arena and arena.enabled():
            try:
                self._arenas = ServerArenas(
                    config.secret,
                    restartable=self.persist.enabled,
                    max_segment=config.max_payload + (1 << 20),
                )
                self._hello_info = json.dumps(self._arenas.info()).encode()
            except OSError as exc:
                log.warning("no shared arena for clients on this host: %s", exc)
        log.info(
            "parameter server on %s: mode=%s optimizer=%s workers=%d%s",
            self.address,
            config.mode,
            "per init (default " + describe(default_optimizer()) + ")"
            if config.optimizer is None
            else describe(self.service.store.default_spec),
            config.workers,
            " (signed)" if config.secret else "",
        )

    # ---------------------------------------------------------------- lifecycle
    def stop(self) -> None:
        """Ask the loop to finish (from any thread)."""
        self._stop.set()

    def serve(self) -> None:
        """Run until :meth:`stop` or a shutdown request; checkpoints and closes on exit."""
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self._arenas is not None:
            self._arenas.attach(poller)
        hb_every = min(1.0, self.config.heartbeat_timeout / 4)
        next_hb = time.monotonic() + hb_every
        next_ckpt = time.monotonic() + self.config.checkpoint_every
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(_POLL_MS))
                if events:
                    readable = self._sock in events
                    if self._arenas is not None and len(events) > readable:  # an arena's too
                        self._arenas.ready(events)
                    self._drain(ask=not readable)
                    self.service.run_queue()
                    self._commit()
                self.service.expire_waits()
                now = time.monotonic()
                if now >= next_hb:
                    next_hb = now + hb_every
                    self.service.expire_workers()
                if now >= next_ckpt or self.persist.log_full:
                    next_ckpt = now + self.config.checkpoint_every
                    self.service.checkpoint()
        finally:
            self.close()

    def close(self) -> None:
        """Write a last checkpoint and release the socket; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.service.checkpoint()
            self._goodbye()
        finally:
            if self._arenas is not None:
                self._arenas.close()
            self.persist.close()
            self._sock.close(linger=1000)
            self._ctx.term()
            log.info("parameter server on %s closed", self.address)

    def _goodbye(self) -> None:
        """Tell every client this server is going; ``aux`` 1: it can be restarted from
        its checkpoint (clients wait for it), 0: its state is gone (clients fail)."""
        restartable = int(self.persist.enabled)
        header = protocol.Header(op=Op.BYE, flags=protocol.FLAG_REPLY, aux=restartable)
        for routing in self._peers:
            frames = protocol.encode(header, "", None, secret=self.config.secret)
            self._send([routing, *frames])

    # ------------------------------------------------------------- persistence
    def _commit(self) -> None:
        """Answer flushes and held acknowledgements once what they cover is on disk."""
        if not self._flushes and not self._held and not self.persist.durable:
            return
        if self._flushes and not self.persist.durable:
            self.service.checkpoint()
        if self.persist.commit():
            self.counters["log_syncs"] += 1
        flushes, self._flushes = self._flushes, []
        for msg in flushes:
            self._reply(msg, aux=self.service.durable_low(msg.header.worker_id, msg.header.session))
        held, self._held = self._held, []
        for frames in held:
            self._send(frames)

    # ---------------------------------------------------------------- receive
    def _drain(self, *, ask: bool = True) -> None:
        """Receive and handle what waits on the socket (``ask``: whether to ask
        before the first receive; not when the poller just said it is readable)."""
        for _ in range(10_000):
            # Asked first: an empty receive's zmq.Again costs more than the ask, and
            # zmq_poll asks for ZMQ_EVENTS for half the cost of getsockopt.
            if ask and not zmq.zmq_poll(self._poll_items, 0):
                return
            ask = True
            try:
                frames = frame_io.receive_routed(self._sock)
            except zmq.Again:
                return
            self._receive(frames)

    def _receive(self, frames: list[Any]) -> None:
        self.counters["received"] += 1
        if len(frames) < 2:
            self.counters["dropped_malformed"] += 1
            return
        routing = frames[0]
        msg = None
        if len(frames) == 2:  # one packed frame: most requests, read in one step
            msg = small.read_request(frames[1], self.config.secret, self.config.max_payload)
        if msg is None:
            try:
                msg = protocol.decode(
                    frames[1:],
                    secret=self.config.secret,
                    max_payload=self.config.max_payload,
                    arena=None if self._arenas is None else self._arenas.resolve,
                )
                if msg.header.is_reply:
                    raise ProtocolError("a reply sent to a server")
            except ProtocolError as exc:
                refusal = self.rejects.reject(frames, exc)
                if refusal is not None:
                    self._send(refusal)
                return
        msg.routing = [routing]
        self._peers.add(routing)
        h = msg.header
        if h.flags & protocol.FLAG_ARENA:
            self.counters["arena_payloads"] += 1
        self.service.seen(h.worker_id)  # liveness; membership comes with a valid push
        if h.op in _DATA_OPS or h.op == Op.FLUSH:
            if h.incarnation != self.incarnation:
                self.counters["stale_incarnation"] += 1
                self._reply(msg, Status.STALE_INCARNATION, b"server restarted; say hello again")
            elif h.op == Op.FLUSH:
                self._flushes.append(msg)  # answered after the queued requests ran
            else:
                self.service.enqueue(msg)
        elif h.op == Op.HELLO:
            self._greeted.add((h.worker_id, h.session))
            self._reply(
                msg, aux=self.service.applied_low(h.worker_id, h.session), payload=self._hello_info
            )
        elif h.op == Op.HEARTBEAT:
            self._reply(msg)
        elif h.op == Op.STATS:
            self._reply(msg, payload=json.dumps(self.service.stats()).encode())
        elif h.op == Op.MEMBERS:  # answered at once: no queued push may wait on it
            told = msg.meta_json()
            self.service.set_members(list(told["members"]), int(told["generation"]))
            self._reply(msg)
        elif h.op == Op.SHUTDOWN:
            self._shutdown(msg)

    def _shutdown(self, msg: Message) -> None:
        """Stop, if ``msg`` comes from a worker that said hello to this incarnation
        (with a secret, :func:`~gradhub.ps.wire.protocol.decode` has checked its
        signature); else refuse it with a log line and keep serving. A stale
        incarnation is answered ``STALE_INCARNATION``, as a data request is: a real
        client says hello again and resends it."""
        h = msg.header
        if h.incarnation == self.incarnation and (h.worker_id, h.session) in self._greeted:
            log.info("shutdown requested by worker %d", h.worker_id)
            self._reply(msg)
            self._stop.set()
            return
        self.counters["refused_shutdowns"] += 1
        stale = h.incarnation != self.incarnation
        why = (
            f"it names incarnation {h.incarnation}, not this server's"
            if stale
            else f"worker {h.worker_id} (session {h.session}) has not said hello to this server"
        )
        log.warning("shutdown refused (%s); serving on", why)
        status = Status.STALE_INCARNATION if stale else Status.REFUSED
        self._reply(msg, status, f"shutdown refused: {why}".encode())

    # ------------------------------------------------------------------ reply
    def _reply(
        self,
        msg: Message,
        status: Status = Status.OK,
        payload: torch.Tensor | bytes | None = None,
        *,
        aux: int = 0,
        meta: bytes = b"",
    ) -> None:
        """Answer ``msg`` (the service's ``reply``)."""
        if payload is None and not meta:  # an acknowledgement: one frame, packed at once
            h = msg.header
            frame = small.pack(
                h.op,
                protocol.FLAG_REPLY,
                status,
                msg.key.encode("utf-8"),
                h.worker_id,
                h.priority,
                h.request_id,
                h.session,
                h.seq,
                self.incarnation,
                aux,
                self.config.secret,
            )
            if self.persist.durable and status == Status.OK and h.op in MUTATING:
                self._held.append([*msg.routing, frame])  # sent by _commit, once the log is synced
                return
            try:
                for part in msg.routing:
                    self._sock.send(part, zmq.SNDMORE)
                self._sock.send(frame)
            except zmq.ZMQError as exc:  # the peer went away; its retry will find us
                log.debug("reply lost: %s", exc)
                return
            self.counters["replied"] += 1
            return
        header = protocol.reply(msg.header, incarnation=self.incarnation, status=status, aux=aux)
        locator = None
        if isinstance(payload, torch.Tensor) and self._copies_out(msg):
            locator, payload = self._into_arena(msg, payload)
        frames = [
            *msg.routing,
            *protocol.encode(
                header,
                msg.key,
                payload,
                meta=meta,
                secret=self.config.secret,
                arena=locator,
                pack=True,
            ),
        ]
        if self.persist.durable and status == Status.OK and header.op in MUTATING:
            self._held.append(frames)  # sent by _commit, once the log is synced
        else:
            self._send(frames)

    def _copies_out(self, msg: Message) -> bool:
        """Whether a pull reply goes into the client's arena (copied there at once)."""
        return self._arenas is not None and msg.header.op == Op.PULL and b"arena" in msg.meta

    def _into_arena(self, msg: Message, value: torch.Tensor) -> tuple[bytes | None, torch.Tensor]:
        """(locator, the copy of ``value`` in the segment the pull named), or
        ``(None, a snapshot)`` when it does not fit there (the reply carries it)."""
        assert self._arenas is not None
        try:
            where = self._arenas.destination(
                msg.header.session, msg.meta_json(), value, msg.header.request_id
            )
        except ProtocolError:
            where = None
        if where is None or not value.is_contiguous():
            return None, value.detach().clone()
        locator, region = where
        copy = region.view(value.dtype).view(value.shape)
        copy.copy_(value)
        self.counters["arena_replies"] += 1
        if protocol.ARENA_LOCATOR.unpack(locator)[0] >= arena.FIRST_SHARED_ID:
            self.counters["arena_shared_replies"] += 1  # into a user's tensor
        return locator, copy

    def _send(self, frames: list[Any]) -> None:
        try:
            frame_io.send(self._sock, frames)
        except zmq.ZMQError as exc:  # the peer went away; its retry will find us
            log.debug("reply lost: %s", exc)
            return
        self.counters["replied"] += 1


def configure_process(config: ServerConfig) -> None:
    """Settings of a process that runs one server: torch's intra-op threads."""
    torch.set_num_threads(config.threads)
