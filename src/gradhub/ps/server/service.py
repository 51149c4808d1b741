"""What a parameter server does with each request, without the I/O:
:class:`Service` holds the store, the consistency accounting, the exactly-once
ledger, the requests that wait, the counters and the persistence. A
:class:`~gradhub.ps.server.server.Server` owns one and moves the messages: it
hands the service each request and a ``reply`` callable that answers one.

Decisions:
- Queue order: :class:`~gradhub.ps.lanes.PriorityLanes` with one lane per
  connection and key: higher priority first, equal priority first in first
  out, and operations of one connection on one key never overtake each other,
  so a pull sees its client's earlier pushes.
- Exactly once: see :mod:`gradhub.ps.server.dedupe`. Every push reply carries, in
  ``aux``, the worker's *durable* low watermark: the sequence numbers up to it
  are on disk (in the last checkpoint, or in the synced write-ahead log of a
  ``durable`` server; without a checkpoint directory: applied). A client keeps
  pushes above it and replays them to a restarted server, so no acknowledged
  push is lost when a server dies between checkpoints.
- Pull replies send a snapshot of the value, shared by every pull until the
  next update: ZeroMQ sends from that memory after the loop moved on, so the
  live value (updated in place) is never handed to it.
- Sync pushes are acknowledged once they joined their round. The round keeps
  the push when its worker is dropped later: the round's sum is applied once
  every remaining live worker pushed for it (and is in the checkpoint until
  then). The pull waits for the round.
- A worker joins the sync/ssp accounting with its first *valid* push: a push
  refused by validation (unknown key, shape, non-finite) does not make it a member.
- A push or pull of a key not initialised yet waits for its ``init`` (see
  :mod:`gradhub.ps.server.waits`); a sync or ssp pull that waits too long is answered
  with an error naming the workers it waits for.
- A push holding NaN or infinity is refused (``NonFiniteError``), nothing changed.
- A surviving job's push (meta ``step`` and ``generation``, any mode) that the
  accounting ignores (its step is applied on the key, or it was made before
  the last membership) is acknowledged and counted as ``push_superseded``,
  never applied (:mod:`gradhub.ps.server.consistency`).
- A *skip push* (meta ``{"skip": true}``, sent for a step a loss scaler
  skipped) counts as the worker's step on the key and applies nothing
  (counted as ``push_skipped``, not in ``push_applied``).
- A key's optimizer state is read (``STATE``) and replaced (``SET_STATE``) in
  the key's lane, so it reflects that client's earlier pushes (a sync push
  once its round is applied); ``SET_STATE`` is applied exactly once and
  logged, as a push. Wire format: :mod:`gradhub.ps.wire.optim_state`.
- Counters count since this server process started (they are not in the
  checkpoint). ``stats()["push_applied_by_worker"]`` splits ``push_applied`` by
  worker id (a string: the report is JSON), all sessions of a worker together,
  so a job whose workers were restarted can check that no push was lost.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from gradhub import codecs
from gradhub.errors import GradhubTimeoutError, NonFiniteError, UnknownParameterError
from gradhub.optim import OptimizerSpec
from gradhub.ps.base import check_like
from gradhub.ps.lanes import PriorityLanes
from gradhub.ps.server.config import NO_OPTIMIZER, ServerConfig, default_optimizer
from gradhub.ps.server.consistency import Consistency
from gradhub.ps.server.dedupe import Ledger
from gradhub.ps.server.persist import Persistence
from gradhub.ps.server.replies import Reply, no_reply
from gradhub.ps.server.store import ParameterStore
from gradhub.ps.server.waits import Waits, client_timeout
from gradhub.ps.wire import optim_state, status
from gradhub.ps.wire.protocol import Message, Op, Status
from gradhub.trees import all_finite

log = logging.getLogger(__name__)

_NO_META: dict[str, Any] = {}  # the meta of most pushes (read only)

COUNTERS = (
    "received",
    "replied",
    "init",
    "push_applied",
    "push_skipped",
    "push_duplicate",
    "push_superseded",
    "updates",
    "pull",
    "pull_waited",
    "errors",
    "stale_incarnation",
    "refused_shutdowns",
    "waited_for_init",
    "wait_timeouts",
    "workers_dropped",
    "checkpoints",
    "log_syncs",
)


def make_store(config: ServerConfig) -> ParameterStore:
    """The store for ``config.optimizer``: fixed to a spec, fixed to none, or
    taking the spec each ``init`` brings (``default_optimizer()`` without one)."""
    if config.optimizer is None:
        return ParameterStore(default_optimizer(), fixed=False)
    if config.optimizer == NO_OPTIMIZER:
        return ParameterStore(None, fixed=True)
    assert isinstance(config.optimizer, OptimizerSpec)  # ServerConfig normalised it
    return ParameterStore(config.optimizer, fixed=True)


class Service:
    """The request semantics of one parameter server.

    ``reply`` answers a request (the server's I/O); ``copies_out(msg)`` says
    whether the reply to a pull copies its payload before ``reply`` returns
    (then the pull needs no snapshot of the value). ``incarnation`` and
    :attr:`address` (set once the server is bound) are reported by :meth:`stats`.
    """

    def __init__(
        self,
        config: ServerConfig,
        *,
        incarnation: int,
        reply: Reply,
        copies_out: Callable[[Message], bool],
    ) -> None:
        self.config = config
        self.address = ""
        self.store = make_store(config)
        self.consistency = Consistency(
            config.mode, workers=config.workers, max_staleness=config.max_staleness
        )
        self.ledger = Ledger()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.pushes_by_worker: dict[int, int] = {}
        self.incarnation = incarnation
        self._durable: dict[int, tuple[int, int]] = {}
        self._snapshots: dict[str, torch.Tensor] = {}
        self._queue: PriorityLanes[tuple[bytes, str], Message] = PriorityLanes()
        self._next: Message | None = None  # a request queued alone (see _enqueue)
        self._rounds = Waits()  # pulls waiting for a sync round or for slow workers (ssp)
        self._inits = Waits()  # pushes and pulls of keys not initialised yet
        self._dirty = False
        self._reply = reply
        self._copies_out = copies_out
        self.persist = Persistence(config)

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

    def restore(self) -> None:
        """Load the checkpoint, then replay the requests logged after it."""
        state, logged = self.persist.start()
        if state is not None:
            self.store.load_state_dict(state["store"])
            self.ledger.load_state_dict(state["ledger"])
            self.consistency.load_state_dict(state["consistency"])
            self._durable = self.ledger.lows()
            log.info("resumed %d key(s) from checkpoint %s", len(self.store), self.persist.path)
        if logged:
            reply, self._reply = self._reply, no_reply
            try:
                for msg in logged:
                    msg.routing = [b""]
                    h = msg.header
                    if h.status == Status.OK:
                        self._execute(msg)
                    else:  # a request that was refused
                        self.ledger.mark(h.worker_id, h.session, h.seq, refused=True)
            finally:
                self._reply = reply
            log.info("replayed %d logged request(s)", len(logged))
            self.checkpoint()

    def seen(self, worker: int) -> None:
        """A message from ``worker`` arrived: it is alive (a member of the sync/ssp
        accounting only from its first valid push)."""
        self.consistency.seen(worker)

    def applied_low(self, worker: int, session: int) -> int:
        """The sequence number up to which ``worker``'s ``session`` is applied (a
        hello reply's ``aux``)."""
        return self.ledger.low(worker, session)

    def durable_low(self, worker: int, session: int) -> int:
        """The sequence number up to which ``worker``'s ``session`` is on disk."""
        if not self.persist.enabled or self.persist.durable:
            return self.ledger.low(worker, session)
        sess, low = self._durable.get(worker, (0, 0))
        return low if sess == session else 0

    def stats(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "incarnation": self.incarnation,
            "keys": len(self.store),
            "parked_pulls": len(self._rounds),
            "waiting_for_init": len(self._inits),
            "counters": dict(self.counters),
            "push_applied_by_worker": {str(w): n for w, n in sorted(self.pushes_by_worker.items())},
            **self.consistency.summary(),
        }

    def enqueue(self, msg: Message) -> None:
        """Queue a data request; the first one into an empty queue waits aside in
        ``_next`` (the queue's order is kept: it is the first one out)."""
        if self._next is None and not self._queue:
            self._next = msg
            return
        if self._next is not None:
            first, self._next = self._next, None
            self._queue.push((first.routing[0], first.key), first, first.header.priority)
        self._queue.push((msg.routing[0], msg.key), msg, msg.header.priority)

    def run_queue(self) -> None:
        """Run the queued data requests, in their order."""
        if self._next is not None:
            first, self._next = self._next, None
            self._execute(first)
        while (taken := self._queue.pop()) is not None:
            self._execute(taken[1])

    def _execute(self, msg: Message) -> None:
        op = msg.header.op
        try:
            if op == Op.INIT:
                self._init(msg)
            elif op == Op.PUSH:
                self._push(msg)
            elif op == Op.STATE:
                self._state(msg)
            elif op == Op.SET_STATE:
                self._set_state(msg)
            else:
                self._pull(msg)
        except Exception as exc:
            self._fail(msg, exc)

    def _fail(self, msg: Message, exc: BaseException) -> None:
        """Answer ``msg`` with the status of ``exc``; a refused init or push is settled."""
        op = msg.header.op
        code = status.status_of(exc)
        if code == Status.INTERNAL:
            log.error("%s of key %r failed", op.name, msg.key, exc_info=exc)
        if op not in (Op.PULL, Op.STATE):  # settled: the durable watermark passes it
            h = msg.header
            self.ledger.mark(h.worker_id, h.session, h.seq, refused=True)
            self.persist.log(msg, refused=True)
            self._dirty = True
        self.counters["errors"] += 1
        self._reply(msg, code, str(exc).encode("utf-8", errors="replace"))

    def _hold_for_init(self, msg: Message) -> None:
        """A push or pull of a key not initialised yet waits for its init."""
        if self._inits.hold(msg.key, msg, time.monotonic()):
            self.counters["waited_for_init"] += 1

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
            for waiting in self._inits.release(msg.key):
                self._queue.push((waiting.routing[0], msg.key), waiting, waiting.header.priority)
        self._reply(msg, aux=self.durable_low(h.worker_id, h.session))

    def _push(self, msg: Message) -> None:
        h = msg.header
        if self.ledger.applied(h.worker_id, h.session, h.seq):
            self.counters["push_duplicate"] += 1
            self._reply(msg, aux=self.durable_low(h.worker_id, h.session))
            return
        if msg.key not in self.store:
            self._hold_for_init(msg)
            return
        # A small gradient in the store's own tensor, checked (nothing keeps it past
        # this push: a sync round sums into a copy); else the general path decides.
        grad = None
        if h.codec == "none":
            grad = self.store.small_grad(msg.key, h.dtype, h.shape, msg.payload)
        small = grad is not None
        if grad is None:
            value = self.store.value(msg.key)
            grad = msg.tensor()
            if h.codec != "none":
                grad = codecs.get(h.codec).decode(grad).to(value.dtype)
            check_like(msg.key, value, grad)
            if grad.is_floating_point() and not all_finite(grad):
                raise NonFiniteError(f"push of {msg.key!r} holds NaN or infinity; refused")
        meta = msg.meta_json() if msg.meta else _NO_META
        hyper = meta.get("hyperparameters")
        if hyper:
            self.store.set_hyperparameters(msg.key, hyper)
        skip = bool(meta.get("skip"))
        # Answered before its update where nothing after this point can fail: a small
        # gradient, checked, an update that is one add_ or copy_, no log to sync
        # first. The update runs while the answer travels, before any later request.
        early = small and not self.persist.durable and self.store.plain_update(msg.key)
        early = early and "step" not in meta  # a surviving job's push may be held or ignored
        if early:
            self._accepted(msg, skip)
        self.consistency.seen(h.worker_id, pushing=True)  # valid: a member from now on
        step, generation = meta.get("step"), meta.get("generation")
        totals = self.consistency.push(
            h.worker_id, msg.key, grad, skip=skip, step=step, generation=generation
        )
        for total in totals or ():
            self._apply(msg.key, total)
        self.persist.log(msg)
        if not early:
            self._accepted(msg, skip, applied=totals is not None)
        self._wake(msg.key)

    def _accepted(self, msg: Message, skip: bool, applied: bool = True) -> None:
        """Mark a push applied (or ignored: ``applied=False``), count it and answer it."""
        h = msg.header
        self.ledger.mark(h.worker_id, h.session, h.seq)
        self._dirty = True
        if not applied:
            self.counters["push_superseded"] += 1
        elif skip:
            self.counters["push_skipped"] += 1
        else:
            self.counters["push_applied"] += 1
            self.pushes_by_worker[h.worker_id] = self.pushes_by_worker.get(h.worker_id, 0) + 1
        self._reply(msg, aux=self.durable_low(h.worker_id, h.session))

    def set_members(self, members: list[int], generation: int) -> None:
        """A surviving job's new membership (:mod:`gradhub.ps.server.consistency`):
        the pulls that waited for a dropped round or a dead worker are answered."""
        if self.consistency.set_members(members, generation):
            self._dirty = True
            for key in self._rounds.held_keys():
                self._wake(key)

    def _state(self, msg: Message) -> None:
        """Answer with the key's optimizer state (after the pushes queued before it)."""
        meta, payload = optim_state.pack(self.store.optimizer_state(msg.key))
        self._reply(msg, payload=payload, meta=json.dumps(meta).encode())

    def _set_state(self, msg: Message) -> None:
        """Replace the key's optimizer state; exactly once, logged like a push."""
        h = msg.header
        if not self.ledger.applied(h.worker_id, h.session, h.seq):
            state = optim_state.unpack(msg.meta_json(), msg.tensor())
            self.store.set_optimizer_state(msg.key, state)
            self.persist.log(msg)
            self.ledger.mark(h.worker_id, h.session, h.seq)
            self._dirty = True
        self._reply(msg, aux=self.durable_low(h.worker_id, h.session))

    def _apply(self, key: str, grad: torch.Tensor) -> None:
        self.store.apply(key, grad)
        self._snapshots.pop(key, None)
        self.counters["updates"] += 1

    def _pull(self, msg: Message) -> None:
        if msg.key not in self.store:
            self._hold_for_init(msg)
        elif self.consistency.pull_ready(msg.header.worker_id, msg.key):
            self._answer_pull(msg)
        elif self._rounds.hold(msg.key, msg, time.monotonic()):
            self.counters["pull_waited"] += 1

    def _answer_pull(self, msg: Message) -> None:
        if self._copies_out(msg):
            self.counters["pull"] += 1
            self._reply(msg, payload=self.store.value(msg.key))
            return
        snap = self._snapshots.get(msg.key)
        if snap is None:
            snap = self._snapshots[msg.key] = self.store.value(msg.key).detach().clone()
        self.counters["pull"] += 1
        self._reply(msg, payload=snap)

    def _wake(self, key: str) -> None:
        if not self._rounds:
            return
        ready = self._rounds.release(
            key, lambda m: self.consistency.pull_ready(m.header.worker_id, key)
        )
        for msg in ready:
            self._answer_pull(msg)

    def expire_waits(self) -> None:
        """Answer the held requests whose time is up, naming whom or what they wait for."""
        if not self._rounds and not self._inits:
            return
        now = time.monotonic()
        for key, msg in self._rounds.expired(now):
            self.counters["wait_timeouts"] += 1
            why = self.consistency.waiting_for(msg.header.worker_id, key)
            self._fail(msg, GradhubTimeoutError(f"{why} (after {client_timeout(msg):g}s)"))
        for key, msg in self._inits.expired(now):
            self.counters["wait_timeouts"] += 1
            self._fail(
                msg,
                UnknownParameterError(
                    f"unknown parameter key {key!r}: no init({key!r}, ...) arrived within "
                    f"{client_timeout(msg):g}s; call init({key!r}, ...) first"
                ),
            )

    def expire_workers(self) -> None:
        """Drop silent workers; the rounds and pulls that waited for them go on."""
        dropped = self.consistency.expire(self.config.heartbeat_timeout)
        if not dropped:
            return
        self.counters["workers_dropped"] += len(dropped)
        for key in self.consistency.tracked_keys():
            for total in self.consistency.complete_rounds(key):
                self._apply(key, total)
                self._dirty = True
        for key in self._rounds.held_keys():
            self._wake(key)
