"""The ``sharded`` strategy's optimizer state, whole, from one rank alone.

The state lives in pieces (:class:`~gradhub.collective.sharded_optimizer.Piece`):
each rank holds the part of every parameter's state that lies in its slice.
DDP scripts call ``optimizer.state_dict()`` on rank 0 alone (nanoGPT,
imagenet) while the other ranks go on to the next step, where they wait in
a collective for rank 0: a collective here would deadlock until the timeout.
Instead every rank runs a :class:`ShardResponder`: a thread that waits on
the job's c10d store for requests and answers with its pieces, serialised
into the store in chunks under its 8 MiB value limit. The requester collects
every other rank's answer within the group's timeout, or raises
:class:`~gradhub.errors.CollectiveTimeoutError` naming the ranks that did
not answer.

Beside the responder: the conversions between the pieces and a plain
optimizer's state dict (:func:`assemble`, :func:`plain_state_dict`,
:func:`per_parameter`, :func:`load_pieces`).

Decisions:
- The responder reads its pieces under the slice optimizer's lock, so it
  never sees a state half-way through a step. The state it answers with is
  the one of the requester's last step: a rank cannot step further before
  the requester joins its next reduce-scatter, and it stepped that far before
  the requester's last weight all-gather could finish.
- Each responder (and each requester) has its own connection to the store
  (a ``TCPStore`` client): a wait blocks the connection it runs on, and the
  group's own store traffic must not queue behind it. The responder blocks
  in ``store.wait`` (no polling); ``close`` wakes it with a stop request.
- Requests to one rank are numbered by a store counter, so requests from
  several ranks at once (every rank checkpointing) are served in turn.
- A rank keeps answering after it is done: ``close`` (and, for a script that
  never closes its model, the interpreter's exit) waits until every rank has
  closed, bounded by the timeout, so rank 0's checkpoint after the last step
  (imagenet's, while the other ranks exit) gets every piece. A rank that is
  failing (``close`` while an exception propagates, or an exit by an
  uncaught exception) does not wait: its failure reaches the launcher at once.
- Keys live under ``gradhub/sharded/<n>/``, ``n`` agreed at set-up, and the
  requester deletes what it read.
"""

from __future__ import annotations

import atexit
import io
import logging
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradhub.collective.sharded_optimizer import ShardedOptimizer
from gradhub.errors import InvalidOptionError, MisuseError, StateError
from gradhub.transports.c10d_errors import RESTART, is_timeout, translate
from gradhub.transports.stores import store_name

log = logging.getLogger("gradhub.train")

PieceState = tuple[int, int, dict[str, Any]]
"""(parameter index, offset of the piece inside the parameter, its state)."""

CHUNK = 4 << 20
"""Bytes per store value (the TCPStore refuses values over 8 MiB)."""

_IDLE = timedelta(hours=1)  # a responder's wait; it loops on, close() wakes it


def pieces_state(opt: ShardedOptimizer, *, to_cpu: bool) -> list[PieceState]:
    """This rank's pieces of the state (copies), read under the optimizer's lock."""
    with opt.lock:
        return _copied(opt, to_cpu)


def stepped_pieces(opt: ShardedOptimizer, *, to_cpu: bool) -> tuple[int, list[PieceState]]:
    """:func:`pieces_state` with the number of steps that made it, read together."""
    with opt.lock:
        return opt.steps, _copied(opt, to_cpu)


def _copied(opt: ShardedOptimizer, to_cpu: bool) -> list[PieceState]:
    out: list[PieceState] = []
    for piece in opt.pieces:
        state = opt.optimizer.state.get(piece.view)
        if state:
            copied = {
                k: (v.detach().to("cpu" if to_cpu else v.device, copy=True))
                if isinstance(v, torch.Tensor)
                else v
                for k, v in state.items()
            }
            out.append((piece.index, piece.offset, copied))
    return out


def every_rank_pieces(
    opt: ShardedOptimizer, responder: ShardResponder | None, *, between: bool
) -> list[PieceState]:
    """Every rank's pieces of the state after the same step: this rank's read here,
    the others' through ``responder``. ``between``: called between a synchronising
    backward and its step, where other ranks may have stepped their slices already."""
    if responder is None:
        return pieces_state(opt, to_cpu=False)
    me = responder.rank
    if between:
        raise MisuseError(
            f"[rank {me}] optimizer.state_dict() between backward() and step() under strategy "
            "'sharded': the other ranks may have stepped their slices already, so the state "
            "would mix two steps\n- help: read it after step() (as a checkpoint does) or "
            "before the backward"
        )
    steps, pieces = stepped_pieces(opt, to_cpu=False)
    for r, payload in sorted(responder.request("optimizer.state_dict()").items()):
        theirs, more = from_bytes(payload)
        if theirs != steps:
            raise StateError(
                f"[rank {me}] optimizer.state_dict(): rank {r}'s slice is after {theirs} "
                f"step(s), this rank's after {steps}; the state would mix two steps"
            )
        pieces.extend(more)
    return pieces


def assemble(
    pieces: list[PieceState], shapes: list[torch.Size], device: torch.device
) -> dict[int, dict[str, Any]]:
    """Per parameter index, its whole state: elementwise tensors concatenated from
    the pieces (in order inside the parameter), anything else the first piece's."""
    by_param: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for index, offset, state in pieces:
        by_param.setdefault(index, []).append((offset, state))
    out: dict[int, dict[str, Any]] = {}
    for index, parts in sorted(by_param.items()):
        parts.sort(key=lambda part: part[0])
        first = parts[0][1]
        whole: dict[str, Any] = {}
        for key, value in first.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                flat = torch.cat([s[key].reshape(-1).to(device) for _, s in parts])
                whole[key] = flat.view(shapes[index])
            else:
                whole[key] = value
        out[index] = whole
    return out


def load_pieces(opt: ShardedOptimizer, states: dict[int, dict[str, Any] | None]) -> None:
    """Replace the pieces' state with their parts of ``states`` (per parameter
    index: its whole state in a plain optimizer's format, or None: no state)."""
    with opt.lock:
        for piece in opt.pieces:
            opt.optimizer.state.pop(piece.view, None)
            whole = states.get(piece.index)
            if not whole:
                continue
            n = piece.view.numel()
            mine: dict[str, Any] = {}
            for key, value in whole.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    part = value.detach().reshape(-1)[piece.offset : piece.offset + n]
                    dtype = piece.view.dtype if value.is_floating_point() else value.dtype
                    mine[key] = part.to(device=piece.view.device, dtype=dtype, copy=True)
                elif isinstance(value, torch.Tensor):
                    mine[key] = value.detach().clone()  # "step": kept as torch keeps it
                else:
                    mine[key] = value
            opt.optimizer.state[piece.view] = mine


def plain_state_dict(
    state: dict[int, dict[str, Any]], live_groups: list[dict[str, Any]]
) -> dict[str, Any]:
    """``state`` (by torch's index) with the live groups, as ``Optimizer.state_dict``
    numbers them: every parameter of every group, in order."""
    numbering: dict[int, int] = {}
    groups: list[dict[str, Any]] = []
    for live in live_groups:
        ids = [numbering.setdefault(id(p), len(numbering)) for p in live["params"]]
        groups.append({**{k: v for k, v in live.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": groups}


def check_groups(state: dict[str, Any], live_groups: list[dict[str, Any]]) -> None:
    """A state dict of another optimizer layout is an :class:`InvalidOptionError`
    (a ``ValueError``) saying how."""
    saved = state["param_groups"]
    if len(saved) != len(live_groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved, live_groups, strict=True)
    ):
        raise InvalidOptionError(
            "the optimizer state dict does not match this optimizer's parameter groups "
            f"({[len(s['params']) for s in saved]} parameters per group vs "
            f"{[len(g['params']) for g in live_groups]})"
        )


def per_parameter(
    state: dict[str, Any], live_groups: list[dict[str, Any]], params: list[torch.nn.Parameter]
) -> dict[int, dict[str, Any] | None]:
    """Per position in ``params``, its entry of a plain state dict (torch's matching:
    the saved indices, group after group, to the live parameters)."""
    saved_ids = [i for g in state["param_groups"] for i in g["params"]]
    live = [p for g in live_groups for p in g["params"]]
    saved_of = {id(p): i for p, i in zip(live, saved_ids, strict=True)}
    entries = state["state"]
    return {
        j: entries.get(saved_of[id(p)], entries.get(str(saved_of[id(p)])))
        for j, p in enumerate(params)
    }


def to_bytes(steps: int, pieces: list[PieceState]) -> bytes:
    """A responder's answer: its pieces and the steps that made them."""
    buffer = io.BytesIO()
    torch.save((steps, pieces), buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> tuple[int, list[PieceState]]:
    loaded: tuple[int, list[PieceState]] = torch.load(io.BytesIO(data), weights_only=True)
    return loaded


def store_client(store: dist.Store, timeout: float) -> dist.Store:
    """A connection of its own to the server behind ``store`` (``store`` itself
    when it is not a TCPStore: a FileStore or a one-process HashStore)."""
    raw = store
    while isinstance(raw, dist.PrefixStore):
        raw = raw.underlying_store
    if isinstance(raw, dist.TCPStore):
        return dist.TCPStore(
            raw.host,
            raw.port,
            is_master=False,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
        )
    return raw


class ShardResponder:
    """Answers other ranks' requests for this rank's pieces; sends this rank's own.

    ``serve`` returns this rank's pieces, serialised. ``prefix`` must be the
    same on every rank of the job and unique in its store.
    """

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        rank: int,
        world_size: int,
        timeout: float,
        serve: Callable[[], bytes],
    ) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self._prefix = prefix
        self._serve = serve
        self._requests = dist.PrefixStore(prefix, store_client(store, timeout))
        self._answers = dist.PrefixStore(prefix, store_client(store, timeout))
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"gradhub-shard-responder-{rank}", daemon=True
        )
        self._thread.start()
        atexit.register(self._at_exit)

    # the requesting side (the caller's thread) -----------------------------------

    def request(self, what: str) -> dict[int, bytes]:
        """Every other rank's serialised pieces, by rank; bounded by the timeout."""
        if self._closed:
            raise StateError(f"[rank {self.rank}] {what}: the strategy was closed")
        store = self._requests
        tickets = {}
        for r in range(self.world_size):
            if r != self.rank:
                tickets[r] = store.add(f"tickets/{r}", 1)
                store.set(f"req/{r}/{tickets[r]}", str(self.rank))
        keys = {r: f"resp/{r}/{t}" for r, t in tickets.items()}
        try:
            store.wait(list(keys.values()), timedelta(seconds=self.timeout))
        except RuntimeError as exc:  # DistStoreError: a timeout, or the store's host is gone
            late = [r for r, k in keys.items() if not store.check([k])] if is_timeout(exc) else []
            raise translate(
                exc,
                what=f"{what} on rank {self.rank}",
                timeout=self.timeout,
                ranks=late,
                lost=f"{store_name(store)} failed: the process that hosts it died or left",
                detail="their part of the sharded optimizer state; is the rank alive with its "
                "prepared model still open?",
                help=f"check that process's log; {RESTART}",
            ) from exc
        out = {}
        for r, key in keys.items():
            header = store.get(key).decode()
            if header.startswith("error:"):
                raise StateError(f"[rank {r}] could not send its optimizer state: {header[6:]}")
            out[r] = b"".join(store.get(f"{key}/{i}") for i in range(int(header)))
            for i in range(int(header)):
                store.delete_key(f"{key}/{i}")
            store.delete_key(key)
            store.delete_key(f"req/{r}/{tickets[r]}")
        return out

    # the answering side (the responder thread) ------------------------------------

    def _run(self) -> None:
        store, ticket = self._answers, 1
        while True:
            key = f"req/{self.rank}/{ticket}"
            try:
                store.wait([key], _IDLE)
                requester = store.get(key).decode()
            except RuntimeError as exc:  # a timeout (wait again) or the store went away
                if self._stopping or not is_timeout(exc):
                    log.debug("[rank %d] shard responder ends: %s", self.rank, exc)
                    return
                continue
            if requester == "stop":
                store.delete_key(key)
                return
            self._answer(store, f"resp/{self.rank}/{ticket}")
            ticket += 1

    def _answer(self, store: dist.Store, key: str) -> None:
        try:
            payload = self._serve()
        except Exception as exc:  # the requester raises it, naming this rank
            log.exception("[rank %d] serialising the optimizer state failed", self.rank)
            store.set(key, f"error:{type(exc).__name__}: {exc}")
            return
        chunks = [payload[i : i + CHUNK] for i in range(0, len(payload), CHUNK)]
        for i, chunk in enumerate(chunks):
            store.set(f"{key}/{i}", chunk)  # type: ignore[arg-type]  # bytes are taken
        store.set(key, str(len(chunks)))

    def close(self) -> None:
        """Answer on until every rank has closed (or the timeout), then stop the
        thread. Idempotent. Called while an exception propagates (a failing
        rank), it stops at once."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        if sys.exc_info()[1] is None:
            self._await_peers()
        self._stop()

    def drop(self) -> None:
        """Stop at once, waiting for no peer (a surviving job's group changed:
        the peers answer under a new responder). Idempotent."""
        if not self._closed:
            self._closed = True
            atexit.unregister(self._at_exit)
            self._stop()

    def _at_exit(self) -> None:
        # A script that never closes the model (DDP scripts do not): a rank that
        # is done still answers a peer's later state_dict() (imagenet saves on
        # rank 0 after the last epoch) unless it dies of an uncaught exception.
        if not self._closed:
            self._closed = True
            if getattr(sys, "last_value", None) is None:
                self._await_peers()
            self._stop()

    def _await_peers(self) -> None:
        """Mark this rank closed; wait (answering) until every rank is."""
        store = self._requests
        try:
            store.set(f"closed/{self.rank}", "1")
            if store.add("closed", 1) >= self.world_size:
                store.set("all closed", "1")
                return
            store.wait(["all closed"], timedelta(seconds=self.timeout))
        except RuntimeError as exc:  # a timeout, or the store's host exited
            try:
                late = [r for r in range(self.world_size) if not store.check([f"closed/{r}"])]
            except RuntimeError:
                late = []
            if late:
                log.warning(
                    "[rank %d] stops answering for the sharded optimizer state although "
                    "rank(s) %s did not close within %gs (%s)",
                    self.rank,
                    ", ".join(map(str, late)),
                    self.timeout,
                    exc,
                )

    def _stop(self) -> None:
        self._stopping = True
        try:
            ticket = self._requests.add(f"tickets/{self.rank}", 1)
            self._requests.set(f"req/{self.rank}/{ticket}", "stop")
        except RuntimeError as exc:  # the store is gone (its host exited): the thread ends too
            log.debug("[rank %d] could not stop the shard responder: %s", self.rank, exc)
        self._thread.join(timeout=min(self.timeout, 10.0))

    def __enter__(self) -> ShardResponder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
