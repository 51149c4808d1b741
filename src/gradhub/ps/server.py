"""The parameter-server process: a :class:`ParameterStore` behind a ROUTER socket.

One thread runs the loop: it drains every message waiting on the socket,
queues data operations (init, push, pull) by priority, runs them, answers
control operations (hello, heartbeat, stats, shutdown) at once, expires silent
workers and writes checkpoints. Being single-threaded, it needs no locks and
its checkpoints are consistent by construction.

Decisions:
- Queue order: :class:`~gradhub.ps.lanes.PriorityLanes` with one lane per
  connection and key: higher priority first, equal priority first in first
  out, and operations of one connection on one key never overtake each other,
  so a pull sees its client's earlier pushes.
- Exactly once: see :mod:`gradhub.ps.dedupe`. Every push reply carries, in
  ``aux``, the worker's *durable* low watermark: the sequence numbers up to it
  are on disk (in the last checkpoint, or in the synced write-ahead log of a
  ``durable`` server; without a checkpoint directory: applied). A client keeps
  pushes above it and replays them to a restarted server, so no acknowledged
  push is lost when a server dies between checkpoints; a ``FLUSH`` request
  writes a checkpoint at once (after the requests queued before it), so a
  client can stop keeping them (``RemoteParameterServer.flush``).
- Durable servers (:mod:`gradhub.ps.wal`): applied inits and pushes are logged
  and their acknowledgements held until the log is synced, once per batch of
  requests drained from the socket (group commit).
- Every reply carries the server's *incarnation* (random per start); a data
  request naming another incarnation is answered ``STALE_INCARNATION`` so the
  client says hello again and replays before anything else is served.
- Pull replies send a snapshot of the value, shared by every pull until the
  next update: ZeroMQ sends from that memory after the loop moved on, so the
  live value (updated in place) is never handed to it.
- Sync pushes are acknowledged once they joined their round (the round keeps
  the push also when its worker is dropped later: the round's sum is applied
  once the remaining live workers pushed); the pull waits for the round.
- A worker joins the sync/ssp accounting with its first *valid* push: a push
  refused by validation (unknown key, shape) does not make it a member.
- Dropped and counted, never answered: malformed, unauthenticated, oversized
  and unknown-op messages.
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

from gradhub import codecs
from gradhub.errors import (
    AuthenticationError,
    BindError,
    OversizedError,
    ProtocolError,
    UnknownOpError,
)
from gradhub.optim import OptimizerSpec
from gradhub.ps import protocol, status
from gradhub.ps.base import check_like
from gradhub.ps.config import DEFAULT_OPTIMIZER, NO_OPTIMIZER, ServerConfig
from gradhub.ps.consistency import Consistency
from gradhub.ps.dedupe import Ledger
from gradhub.ps.lanes import PriorityLanes
from gradhub.ps.persist import Persistence
from gradhub.ps.protocol import Message, Op, Status
from gradhub.ps.store import ParameterStore, describe

log = logging.getLogger(__name__)

_DATA_OPS = (Op.INIT, Op.PUSH, Op.PULL)
_POLL_MS = 100


def make_store(config: ServerConfig) -> ParameterStore:
    """The store for ``config.optimizer``: fixed to a spec, fixed to none, or
    taking the spec each ``init`` brings (``DEFAULT_OPTIMIZER`` without one)."""
    if config.optimizer is None:
        return ParameterStore(DEFAULT_OPTIMIZER, fixed=False)
    if config.optimizer == NO_OPTIMIZER:
        return ParameterStore(None, fixed=True)
    assert isinstance(config.optimizer, OptimizerSpec)  # ServerConfig normalised it
    return ParameterStore(config.optimizer, fixed=True)


class Server:
    """A parameter server bound to ``config.bind``; :meth:`serve` runs its loop.

    The socket is bound in the constructor, so :attr:`address` is known before
    serving starts (``*`` ports resolved).
    """

    def __init__(self, config: ServerConfig):
        self.config = config
        self.incarnation = secrets.randbits(63) | 1
        self.store = make_store(config)
        self.consistency = Consistency(
            config.mode, workers=config.workers, max_staleness=config.max_staleness
        )
        self.ledger = Ledger()
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "received",
                "replied",
                "init",
                "push_applied",
                "push_duplicate",
                "updates",
                "pull",
                "pull_waited",
                "errors",
                "stale_incarnation",
                "dropped_malformed",
                "dropped_unauthenticated",
                "dropped_oversized",
                "dropped_unknown_op",
                "workers_dropped",
                "checkpoints",
            ),
            0,
        )
        self._durable: dict[int, tuple[int, int]] = {}
        self._snapshots: dict[str, torch.Tensor] = {}
        self._queue: PriorityLanes[tuple[bytes, str], Message] = PriorityLanes()
        self._parked: dict[str, list[Message]] = {}
        self._dirty = False
        self._stop = threading.Event()
        self._closed = False
        self._flushes: list[Message] = []
        self._held: list[list[Any]] = []  # replies waiting for the log's sync
        self._replaying = False
        self.persist = Persistence(config)
        self._restore()
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
            raise BindError(f"cannot bind parameter server to {config.bind}: {exc}") from exc
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info(
            "parameter server on %s: mode=%s optimizer=%s workers=%d%s",
            self.address,
            config.mode,
            "per init (default " + describe(DEFAULT_OPTIMIZER) + ")"
            if config.optimizer is None
            else describe(self.store.default_spec),
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
        hb_every = min(1.0, self.config.heartbeat_timeout / 4)
        next_hb = time.monotonic() + hb_every
        next_ckpt = time.monotonic() + self.config.checkpoint_every
        try:
            while not self._stop.is_set():
                if poller.poll(_POLL_MS):
                    self._drain()
                    self._run_queue()
                    self._commit()
                now = time.monotonic()
                if now >= next_hb:
                    next_hb = now + hb_every
                    self._expire()
                if now >= next_ckpt or self.persist.log_full:
                    next_ckpt = now + self.config.checkpoint_every
                    self.checkpoint()
        finally:
            self.close()

    def close(self) -> None:
        """Write a last checkpoint and release the socket; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.checkpoint()
        finally:
            self.persist.close()
            self._sock.close(0)
            self._ctx.term()
            log.info("parameter server on %s closed", self.address)

    # ------------------------------------------------------------- checkpoints
    def checkpoint(self) -> None:
        """Write values, optimizer state, accounting and applied sequence numbers."""
        if not self.persist.enabled or not self._dirty:
            return
        state = {
            "format": 1,
            "mode": self.config.mode,
            "store": self.store.state_dict(),
            "ledger": self.ledger.state_dict(),
            "consistency": self.consistency.state_dict(),
        }
        self.persist.save(state)
        self._durable = self.ledger.lows()
        self._dirty = False
        self.counters["checkpoints"] += 1
        log.debug("checkpoint written to %s", self.persist.path)

    def _restore(self) -> None:
        state, logged = self.persist.start()
        if state is not None:
            self.store.load_state_dict(state["store"])
            self.ledger.load_state_dict(state["ledger"])
            self.consistency.load_state_dict(state["consistency"])
            self._durable = self.ledger.lows()
            log.info("resumed %d key(s) from checkpoint %s", len(self.store), self.persist.path)
        if logged:
            self._replaying = True
            try:
                for msg in logged:
                    msg.routing = [b""]
                    h = msg.header
                    if h.status == Status.OK:
                        self._execute(msg)
                    else:  # a request that was refused
                        self.ledger.mark(h.worker_id, h.session, h.seq, refused=True)
            finally:
                self._replaying = False
            log.info("replayed %d logged request(s)", len(logged))
            self.checkpoint()

    def _durable_low(self, worker: int, session: int) -> int:
        if not self.persist.enabled or self.persist.durable:
            return self.ledger.low(worker, session)
        sess, low = self._durable.get(worker, (0, 0))
        return low if sess == session else 0

    def _commit(self) -> None:
        """Answer flushes and held acknowledgements once what they cover is on disk."""
        if self._flushes and not self.persist.durable:
            self.checkpoint()
        self.persist.commit()
        flushes, self._flushes = self._flushes, []
        for msg in flushes:
            self._reply(msg, aux=self._durable_low(msg.header.worker_id, msg.header.session))
        held, self._held = self._held, []
        for frames in held:
            self._send(frames)

    # ---------------------------------------------------------------- receive
    def _drain(self) -> None:
        for _ in range(10_000):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._receive(frames)

    def _receive(self, frames: list[Any]) -> None:
        self.counters["received"] += 1
        if len(frames) < 2:
            self.counters["dropped_malformed"] += 1
            return
        routing = frames[0].bytes
        try:
            msg = protocol.decode(
                frames[1:], secret=self.config.secret, max_payload=self.config.max_payload
            )
            if msg.header.is_reply:
                raise ProtocolError("a reply sent to a server")
        except ProtocolError as exc:
            self._count_drop(exc)
            return
        msg.routing = [routing]
        h = msg.header
        self.consistency.seen(h.worker_id)  # liveness; membership comes with a valid push
        if h.op in _DATA_OPS or h.op == Op.FLUSH:
            if h.incarnation != self.incarnation:
                self.counters["stale_incarnation"] += 1
                self._reply(msg, Status.STALE_INCARNATION, b"server restarted; say hello again")
            elif h.op == Op.FLUSH:
                self._flushes.append(msg)  # answered after the queued requests ran
            else:
                self._queue.push((routing, msg.key), msg, h.priority)
        elif h.op == Op.HELLO:
            self._reply(msg, aux=self.ledger.low(h.worker_id, h.session))
        elif h.op == Op.HEARTBEAT:
            self._reply(msg)
        elif h.op == Op.STATS:
            self._reply(msg, payload=json.dumps(self.stats()).encode())
        elif h.op == Op.SHUTDOWN:
            log.info("shutdown requested by worker %d", h.worker_id)
            self._reply(msg)
            self._stop.set()

    def _count_drop(self, exc: ProtocolError) -> None:
        if isinstance(exc, AuthenticationError):
            kind = "dropped_unauthenticated"
        elif isinstance(exc, OversizedError):
            kind = "dropped_oversized"
        elif isinstance(exc, UnknownOpError):
            kind = "dropped_unknown_op"
        else:
            kind = "dropped_malformed"
        self.counters[kind] += 1
        log.debug("dropped a message: %s", exc)

    def stats(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "incarnation": self.incarnation,
            "keys": len(self.store),
            "parked_pulls": sum(len(v) for v in self._parked.values()),
            "counters": dict(self.counters),
            **self.consistency.summary(),
        }

    # ------------------------------------------------------------------ queue
    def _run_queue(self) -> None:
        while (taken := self._queue.pop()) is not None:
            self._execute(taken[1])

    def _execute(self, msg: Message) -> None:
        op = msg.header.op
        try:
            if op == Op.INIT:
                self._init(msg)
            elif op == Op.PUSH:
                self._push(msg)
            else:
                self._pull(msg)
        except Exception as exc:
            code = status.status_of(exc)
            if code == Status.INTERNAL:
                log.exception("%s of key %r failed", op.name, msg.key)
            if op != Op.PULL:  # settled: the durable watermark passes it
                h = msg.header
                self.ledger.mark(h.worker_id, h.session, h.seq, refused=True)
                self.persist.log(msg, refused=True)
                self._dirty = True
            self._error(msg, code, exc)

    def _error(self, msg: Message, code: Status, exc: BaseException) -> None:
        self.counters["errors"] += 1
        self._reply(msg, code, str(exc).encode("utf-8", errors="replace"))

    def _init(self, msg: Message) -> None:
        h = msg.header
        if not self.ledger.applied(h.worker_id, h.session, h.seq):
            spec = msg.meta_json().get("optimizer")
            optimizer = None if spec is None else OptimizerSpec.from_dict(spec)
            self.store.init(msg.key, msg.tensor(), optimizer=optimizer)
            self.persist.log(msg)
            self.ledger.mark(h.worker_id, h.session, h.seq)
            self._dirty = True
            self.counters["init"] += 1
        self._reply(msg, aux=self._durable_low(h.worker_id, h.session))

    def _push(self, msg: Message) -> None:
        h = msg.header
        if self.ledger.applied(h.worker_id, h.session, h.seq):
            self.counters["push_duplicate"] += 1
            self._reply(msg, aux=self._durable_low(h.worker_id, h.session))
            return
        value = self.store.value(msg.key)
        grad = msg.tensor()
        if h.codec != "none":
            grad = codecs.get(h.codec).decode(grad).to(value.dtype)
        check_like(msg.key, value, grad)
        hyper = msg.meta_json().get("hyperparameters")
        if hyper:
            self.store.set_hyperparameters(msg.key, hyper)
        self.consistency.seen(h.worker_id, pushing=True)  # valid: a member from now on
        for total in self.consistency.push(h.worker_id, msg.key, grad):
            self._apply(msg.key, total)
        self.persist.log(msg)
        self.ledger.mark(h.worker_id, h.session, h.seq)
        self._dirty = True
        self.counters["push_applied"] += 1
        self._reply(msg, aux=self._durable_low(h.worker_id, h.session))
        self._wake(msg.key)

    def _apply(self, key: str, grad: torch.Tensor) -> None:
        self.store.apply(key, grad)
        self._snapshots.pop(key, None)
        self.counters["updates"] += 1

    def _pull(self, msg: Message) -> None:
        self.store.value(msg.key)  # unknown key: an error now, not after waiting
        if self.consistency.pull_ready(msg.header.worker_id, msg.key):
            self._answer_pull(msg)
        else:
            parked = self._parked.setdefault(msg.key, [])
            rid = (msg.routing, msg.header.request_id)
            if all((m.routing, m.header.request_id) != rid for m in parked):  # not a retry
                self.counters["pull_waited"] += 1
                parked.append(msg)

    def _answer_pull(self, msg: Message) -> None:
        snap = self._snapshots.get(msg.key)
        if snap is None:
            snap = self._snapshots[msg.key] = self.store.value(msg.key).detach().clone()
        self.counters["pull"] += 1
        self._reply(msg, payload=snap)

    def _wake(self, key: str) -> None:
        parked = self._parked.get(key)
        if not parked:
            return
        waiting = []
        for msg in parked:
            if self.consistency.pull_ready(msg.header.worker_id, key):
                self._answer_pull(msg)
            else:
                waiting.append(msg)
        if waiting:
            self._parked[key] = waiting
        else:
            del self._parked[key]

    def _expire(self) -> None:
        dropped = self.consistency.expire(self.config.heartbeat_timeout)
        if not dropped:
            return
        self.counters["workers_dropped"] += len(dropped)
        for key in self.consistency.tracked_keys():
            for total in self.consistency.complete_rounds(key):
                self._apply(key, total)
                self._dirty = True
        for key in list(self._parked):
            self._wake(key)

    # ------------------------------------------------------------------ reply
    def _reply(
        self,
        msg: Message,
        status: Status = Status.OK,
        payload: torch.Tensor | bytes | None = None,
        *,
        aux: int = 0,
    ) -> None:
        if self._replaying:
            return
        header = protocol.reply(msg.header, incarnation=self.incarnation, status=status, aux=aux)
        frames = [
            *msg.routing,
            *protocol.encode(header, msg.key, payload, secret=self.config.secret),
        ]
        if self.persist.durable and status == Status.OK and header.op in (Op.INIT, Op.PUSH):
            self._held.append(frames)  # sent by _commit, once the log is synced
        else:
            self._send(frames)

    def _send(self, frames: list[Any]) -> None:
        try:
            self._sock.send_multipart(frames, copy=False)
        except zmq.ZMQError as exc:  # the peer went away; its retry will find us
            log.debug("reply lost: %s", exc)
            return
        self.counters["replied"] += 1


def configure_process(config: ServerConfig) -> None:
    """Settings of a process that runs one server: torch's intra-op threads."""
    torch.set_num_threads(config.threads)
