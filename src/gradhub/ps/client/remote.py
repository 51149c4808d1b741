"""RemoteParameterServer: the ParameterServer interface over ZeroMQ.

The client is three parts: :mod:`gradhub.ps.client.placement` decides where a key
lives (hashing, slicing), :mod:`gradhub.ps.client.channel` moves requests (one I/O
thread: priority lanes, credit, retries, hello and replay after a server
restart, deadlines), and this module is the public interface over them.

Steps for sync/ssp servers: a worker's step on a key is the number of pushes
it has made to that key; nothing else is needed. In sync mode a pull returns
once the rounds of the worker's pushes are applied; in ssp mode a pull waits
while the worker is more than ``max_staleness`` pushes ahead of the slowest
live worker. Workers stay live by heartbeats (every ``heartbeat_interval``).

Decision: a push sends the caller's gradient memory without a copy (one
replica, no codec): do not modify it until the future is done.

Servers on this host: payloads of ``arena_min_bytes`` or more travel through
a shared-memory arena instead of ZeroMQ (:mod:`gradhub.ps.wire.arena`: a push is
copied once into it, a pull once out of it, a tensor of :meth:`empty_like`
not at all); ``arena=False`` or ``GRADHUB_PS_ARENA=0`` keeps them on ZeroMQ.
A server process on this host that dies without checkpoints fails its
requests at once with ``WorkerFailedError`` (seen through the arena).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from gradhub import codecs
from gradhub._config import config_or_options
from gradhub.errors import ClosedError, NonFiniteError, ServerTimeoutError, UnsupportedOptionError
from gradhub.optim import OptimizerSpec
from gradhub.ps.base import ParameterServer, Replicas, as_replicas, check_key
from gradhub.ps.client import optim_slices
from gradhub.ps.client.addresses import check_address
from gradhub.ps.client.admin import ServerRequests
from gradhub.ps.client.channel import Channel
from gradhub.ps.client.config import ClientConfig
from gradhub.ps.client.link import Request
from gradhub.ps.client.payloads import filler, meta_json
from gradhub.ps.client.pending import all_of
from gradhub.ps.client.placement import DEFAULT_SLICE_BYTES, Piece, layout, server_index, split
from gradhub.ps.client.shared_tensors import SharedTensors
from gradhub.ps.secret import secret_bytes
from gradhub.ps.wire import arena, optim_state
from gradhub.ps.wire.protocol import Message, Op
from gradhub.ps.wire.protocol.small import wire_of
from gradhub.trees import all_finite, finite_array

__all__ = ["DEFAULT_SLICE_BYTES", "ClientConfig", "RemoteParameterServer", "check_address"]

log = logging.getLogger(__name__)


class RemoteParameterServer(ParameterServer):
    """A client of one or more ``gradhub serve`` processes.

    Configured by a :class:`~gradhub.ps.client.config.ClientConfig` (its fields
    say what each setting does): ``RemoteParameterServer(config=ClientConfig(...))``,
    or the same settings as keywords, ``RemoteParameterServer(addresses,
    worker_id=..., secret=..., timeout=..., compress=..., ...)``.
    """

    def __init__(
        self,
        addresses: str | Sequence[str] | None = None,
        *,
        config: ClientConfig | None = None,
        **options: Any,
    ) -> None:
        if addresses is not None:
            if config is not None:
                raise UnsupportedOptionError(
                    "pass the addresses in config= or as an argument, not both"
                )
            options["addresses"] = addresses
        cfg = config_or_options(ClientConfig, config, options)
        self.config = cfg
        self.addresses = cfg.address_list
        self.worker_id = cfg.worker_id
        self.timeout = float(cfg.timeout)
        self.nonfinite = cfg.nonfinite
        self.skipped = 0
        """Pushes dropped because they held NaN or infinity (``nonfinite="skip"``)."""
        self.codec = codecs.get(cfg.compress, for_="RemoteParameterServer")
        self.slice_bytes = int(cfg.slice_bytes)
        self._closed = False
        self._shared = SharedTensors(arena.enabled(cfg.arena))  # empty_like's tensors
        self._channel = Channel(
            self.addresses,
            worker_id=cfg.worker_id,
            secret=secret_bytes(cfg.secret),
            timeout=self.timeout,
            connect_timeout=min(float(cfg.connect_timeout), self.timeout),
            heartbeat_interval=float(cfg.heartbeat_interval),
            retry_interval=float(cfg.retry_interval),
            max_inflight_bytes=int(cfg.max_inflight_bytes),
            arena=arena.enabled(cfg.arena),
            arena_min_bytes=int(cfg.arena_min_bytes),
            shared=self._shared,
        )
        self._admin = ServerRequests(self.addresses, self._channel.submit)

    @property
    def dropped_replies(self) -> int:
        """Replies dropped because they failed to decode or authenticate."""
        return self._channel.dropped_replies

    # ------------------------------------------------------------ public API
    def init(self, key: str, values: Replicas, *, optimizer: OptimizerSpec | None = None) -> None:
        """Store the initial value of ``key`` on its server(s); blocks until acknowledged.

        ``optimizer``: the spec of this key's optimizer on the server (every
        slice gets the same); see :class:`~gradhub.ps.base.ParameterServer`.
        """
        self._check_open()
        check_key(key)
        value = as_replicas(values)[0].detach()
        meta = b"" if optimizer is None else meta_json({"optimizer": optimizer.to_dict()})
        futures = [
            self._submit(Op.INIT, key, piece.key, piece.server, payload=part, meta=meta)
            for piece, part in split(key, value, len(self.addresses), self.slice_bytes)
        ]
        for f in futures:
            f.result()

    def push(
        self,
        key: str,
        grads: Replicas,
        *,
        priority: int = 0,
        hyperparameters: Mapping[str, Any] | None = None,
        skip: bool = False,
        step: tuple[int, int] | None = None,
    ) -> Future[None]:
        """Send the sum of ``grads``; the future is done once the server accepted it.

        ``hyperparameters`` travel in the same message (applied exactly once
        with this push, also when it is retried or replayed). ``skip=True``
        sends a *skip push* (a loss scaler skipped this step): the server
        counts it as this worker's step on the key (ssp staleness; a sync
        round, as a zero contribution) and applies nothing; send zeros.
        ``step``: a surviving job's (step, membership generation) of the push,
        in any mode: the server applies each step of a key once (see
        :meth:`set_members`).
        """
        self._check_open()
        if type(grads) is torch.Tensor and not hyperparameters and not skip and step is None:
            sent = self._push_one(key, grads, priority)
            if sent is not None:
                return sent
        check_key(key)
        fields: dict[str, Any] = {}
        if hyperparameters:
            fields["hyperparameters"] = dict(hyperparameters)
        if skip:
            fields["skip"] = True
        if step is not None:
            fields["step"], fields["generation"] = int(step[0]), int(step[1])
        meta = meta_json(fields) if fields else b""
        reps = [g.detach() for g in as_replicas(grads, what="grads")]
        total = reps[0]
        owned = len(reps) > 1
        if owned:
            total = torch.stack([r.to("cpu") for r in reps]).sum(0)
        floating = total.is_floating_point()
        codec = self.codec.name if floating else "none"
        if codec != "none" and not all_finite(total):
            return self._refuse(key)
        requests = []
        for piece, part in split(key, total, len(self.addresses), self.slice_bytes):
            part_owned = owned
            if codec != "none":
                part, part_owned = self.codec.encode(part), True
            requests.append(
                Request(
                    Op.PUSH,
                    piece.server,
                    key=piece.key,
                    user_key=key,
                    priority=int(priority),
                    payload=part,
                    owned=part_owned,
                    codec=codec,
                    meta=meta,
                )
            )
        # A tensor of empty_like is checked by its server alone (one read, not two).
        served = self.nonfinite == "error" and self._shared.find(total) is not None
        if floating and codec == "none" and not served and not self._stage_finite(requests):
            return self._refuse(key)
        held = None if owned else self._shared.claim(total, writes=False, what=f"push of {key!r}")
        return self._shared.hold(
            all_of(self._channel, [self._channel.submit(r) for r in requests]), [held]
        )

    def _push_one(self, key: str, grad: torch.Tensor, priority: int) -> Future[None] | None:
        """:meth:`push` of one small uncompressed tensor to one server, no arena, as the
        general path sends it; ``None`` (nothing done) for any other. One numpy view
        (:func:`~.protocol.small.wire_of`) answers what that path asks torch one by one."""
        known = wire_of(grad) if type(key) is str else None
        if known is None:
            return None
        wire, array = known
        nbytes, floating = array.nbytes, array.dtype.kind == "f"
        if (
            nbytes > self.slice_bytes
            or nbytes >= self._channel.arena_min_bytes
            or (floating and self.codec.name != "none")
            or self._shared.find(grad) is not None  # empty_like's rules: the general path
        ):
            return None
        if floating and not finite_array(array):
            return self._refuse(key)
        req = Request(Op.PUSH, server_index(key, len(self.addresses)), key=key, user_key=key)
        req.priority, req.payload, req.wire, req.nbytes = int(priority), grad, wire, nbytes
        return self._channel.submit(req)

    def _stage_finite(self, requests: list[Request]) -> bool:
        """Whether the payloads of ``requests`` hold no NaN or infinity. A payload that
        goes through a shared arena is copied there now and checked on the way
        (:func:`gradhub.trees.copy_finite`); a refused push gives its segments back."""
        finite = True
        for req in requests:
            payload = req.payload
            assert payload is not None
            small = payload.numel() * payload.element_size() < self._channel.arena_min_bytes
            staged = None if small else self._channel.stage(req)
            finite = finite and (all_finite(payload) if staged is None else staged)
        if not finite:
            for req in requests:
                self._channel.unstage(req)
        return finite

    def _refuse(self, key: str) -> Future[None]:
        """A push holding NaN or infinity: ``NonFiniteError``, or dropped (``"skip"``)."""
        if self.nonfinite == "error":
            raise NonFiniteError(
                f"push of {key!r} holds NaN or infinity; nothing was sent\n- help: "
                "RemoteParameterServer(..., nonfinite='skip') drops such pushes"
            )
        self.skipped += 1
        log.warning("push of %r holds NaN or infinity: dropped (nonfinite='skip')", key)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def pull(self, key: str, weights: Replicas, *, priority: int = 0) -> Future[None]:
        """Copy the value of ``key`` into every tensor of ``weights``."""
        self._check_open()
        check_key(key)
        targets = as_replicas(weights, what="weights")
        first = targets[0]
        held = self._shared.claim(first, writes=True, what=f"pull of {key!r}")
        flat = None if held is None else first.view(-1)  # the server may write into it
        futures = [
            self._submit(
                Op.PULL,
                key,
                piece.key,
                piece.server,
                priority,
                on_reply=filler(key, targets, piece.span),
                reply_bytes=first.element_size()
                * (first.numel() if piece.span is None else piece.span.stop - piece.span.start),
                into=None if flat is None else flat[piece.span or slice(None)],
            )
            for piece in self._pieces(key, first)
        ]
        return self._shared.hold(all_of(self._channel, futures), [held])

    def empty_like(self, like: torch.Tensor) -> torch.Tensor:
        return self._shared.empty(like.shape, like.dtype)  # ClosedError once closed

    def in_arena(self, tensor: torch.Tensor) -> bool:
        return self._shared.find(tensor) is not None

    def optimizer_state(self, key: str, like: torch.Tensor) -> dict[str, Any]:
        """The state of ``key``'s optimizer on its server(s), after this client's
        requests queued before it on the key; blocks up to ``timeout``.

        ``like``: a tensor of the key's shape and dtype (the parameter). The
        slices of a sliced key are put together (:func:`gradhub.ps.client.optim_slices.join`).
        """
        self._check_open()
        check_key(key)
        pieces = self._pieces(key, like)
        parts: list[dict[str, Any]] = [{} for _ in pieces]

        def keeper(i: int) -> Callable[[Message], None]:
            def keep(msg: Message) -> None:
                parts[i] = optim_state.unpack(msg.meta_json(), msg.tensor())

            return keep

        futures = [
            self._submit(Op.STATE, key, piece.key, piece.server, on_reply=keeper(i))
            for i, piece in enumerate(pieces)
        ]
        for f in futures:
            f.result()
        return optim_slices.join(key, parts, pieces, like)

    def set_optimizer_state(self, key: str, state: Mapping[str, Any], like: torch.Tensor) -> None:
        """Replace the state of ``key``'s optimizer on its server(s) (each slice
        gets its part); applied exactly once; blocks until acknowledged."""
        self._check_open()
        check_key(key)
        pieces = self._pieces(key, like)
        futures = []
        for piece, part in zip(pieces, optim_slices.cut(key, state, pieces, like), strict=True):
            meta, payload = optim_state.pack(part)
            futures.append(
                self._submit(
                    Op.SET_STATE,
                    key,
                    piece.key,
                    piece.server,
                    payload=payload,
                    owned=True,
                    meta=json.dumps(meta).encode(),
                )
            )
        for f in futures:
            f.result()

    def _pieces(self, key: str, like: torch.Tensor) -> list[Piece]:
        """Where the slices of ``key`` (shaped and typed as ``like``) live."""
        nbytes, servers = like.numel() * like.element_size(), len(self.addresses)
        return layout(key, nbytes, like.numel(), servers, self.slice_bytes)

    def stats(self) -> list[dict[str, Any]]:
        """Each server's counters and accounting (blocks up to ``timeout``)."""
        self._check_open()
        return self._admin.stats()

    def set_members(self, members: Sequence[int], generation: int) -> None:
        """Tell every server a surviving job's membership ``generation``: the worker
        ids in ``members`` are its workers from now on. A sync round not applied
        yet is dropped (its step is pushed again), the others leave rounds and
        staleness for good, and a push tagged with an older generation is
        ignored (:mod:`gradhub.ps.server.consistency`). Blocks up to ``timeout``."""
        self._check_open()
        self._admin.set_members(members, generation)

    def shutdown_servers(self) -> None:
        """Ask every server to checkpoint and exit."""
        self._check_open()
        self._admin.shutdown_servers()

    def flush(self, timeout: float | None = None) -> None:
        """Return once every server holds everything it acknowledged to this client on disk.

        Waits for the requests in flight, then asks each server that still has
        acknowledged pushes of this client not on disk to write a checkpoint
        (a ``durable`` server has them on disk already, and one without a
        checkpoint directory keeps nothing across restarts: neither is asked).
        The client keeps those pushes, to replay them to a restarted server,
        until then. ``ServerTimeoutError`` past ``timeout`` (default: the
        client's ``timeout``) names the servers that did not confirm.
        """
        self._check_open()
        self._flush(self.timeout if timeout is None else float(timeout))

    def _flush(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self._channel.busy() and time.monotonic() < deadline:
            time.sleep(0.005)
        waiting = [self._submit(Op.FLUSH, "", "", i) for i in self._channel.unsaved()]
        for future in waiting:
            with contextlib.suppress(Exception):
                future.result(max(0.0, deadline - time.monotonic()))
        missing = [self.addresses[i] for i in self._channel.unsaved()]
        if missing:
            raise ServerTimeoutError(
                ", ".join(missing),
                None,
                "flush",
                timeout,
                "acknowledged pushes of this client are not on disk there yet",
            )

    def close(self, timeout: float | None = 10.0) -> None:
        """Flush (up to ``timeout``: requests in flight answered, acknowledged pushes
        on disk), then stop; idempotent. A server that did not confirm is named
        in a ``ServerTimeoutError``, raised after everything was released."""
        if self._closed:
            return
        try:
            self._flush(self.timeout if timeout is None else float(timeout))
        finally:
            self._closed = True
            self._channel.close()
            self._shared.close()

    def __enter__(self) -> RemoteParameterServer:
        return self

    # --------------------------------------------------------------- helpers
    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this RemoteParameterServer is closed; create a new one")

    def _submit(
        self,
        op: Op,
        user_key: str,
        key: str,
        server: int,
        priority: int = 0,
        *,
        payload: torch.Tensor | None = None,
        owned: bool = False,
        codec: str = "none",
        meta: bytes = b"",
        on_reply: Callable[[Message], None] | None = None,
        reply_bytes: int = 0,
        into: torch.Tensor | None = None,
    ) -> Future[None]:
        return self._channel.submit(
            Request(
                op,
                server,
                key=key,
                user_key=user_key,
                priority=int(priority),
                payload=payload,
                owned=owned,
                codec=codec,
                meta=meta,
                on_reply=on_reply,
                reply_bytes=reply_bytes,
                into=into,
            )
        )
