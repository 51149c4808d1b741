"""One server as the client's channel sees it: its requests and their state.

A :class:`Link` holds, for one server, the requests queued in priority lanes,
those in flight, and those it acknowledged but has not yet put on disk
(*retained*: resent after a restart). :class:`Request` is one request of the
client. Only the channel's I/O thread touches them (``failure`` is also read
under the channel's lock by callers).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from gradhub.errors import AuthenticationError, ClosedError, GradhubError
from gradhub.ps.client.arena import ClientArena, Slot
from gradhub.ps.lanes import PriorityLanes
from gradhub.ps.wire import zmq_errors
from gradhub.ps.wire.protocol import MUTATING, Message, Op
from gradhub.ps.wire.protocol.small import Wire

__all__ = ["MUTATING", "Link", "Request", "closed_error", "dealer", "refused_error"]


@dataclass(slots=True)
class Request:
    """One request of the client; ``key`` is the key on the wire (a slice key for slices)."""

    op: Op
    server: int
    key: str = ""
    user_key: str = ""
    priority: int = 0
    payload: torch.Tensor | None = None
    owned: bool = False  # payload is our own copy (may be kept for replay as is)
    wire: Wire | None = None  # the payload as sent, where its sender has it (small.wire_of)
    codec: str = "none"
    meta: bytes = b""
    on_reply: Callable[[Message], None] | None = None
    future: Future[None] | None = None
    order: int = 0
    request_id: int = 0
    seq: int = 0
    submitted: float = 0.0
    deadline: float = float("inf")
    next_retry: float = float("inf")
    nbytes: int = 0
    reply_bytes: int = 0  # a pull's expected payload (its arena segment's size)
    sends: int = 0
    slot: Slot | None = None  # the arena segment lent to it
    into: torch.Tensor | None = None  # a pull's destination, if it may be a user's arena tensor
    named_user: bool = False  # a send named a user's tensor: cancelled before given up
    cancelling: bool = False  # its cancel is sent, not yet confirmed


@dataclass
class Link:
    address: str
    sock: zmq.Socket[Any]
    incarnation: int = 0
    connected_before: bool = False
    hello: Request | None = None
    next_seq: int = 1
    queue: PriorityLanes[str, Request] = field(default_factory=PriorityLanes)
    inflight: dict[int, Request] = field(default_factory=dict)
    inflight_bytes: int = 0
    retained: dict[int, Request] = field(default_factory=dict)  # acked, not yet durable
    next_heartbeat: float = 0.0
    failure: GradhubError | None = None  # fails every request to this server at once
    arena: ClientArena | None = None  # the shared arena, on the same host
    drained: bool = True  # the last receive found nothing (zmq.FD will signal anew)
    poll_items: list[tuple[Any, int]] = field(default_factory=list)  # zmq_poll's, for sock

    def __post_init__(self) -> None:
        self.poll_items = [(self.sock, zmq.POLLIN)]

    def prune(self, durable: int) -> None:
        """Forget the retained requests the server has on disk (``seq <= durable``)."""
        if not self.retained:
            return
        for seq in [q for q in self.retained if q <= durable]:
            del self.retained[seq]

    def retain(self, req: Request, durable: int) -> None:
        """Keep an acknowledged ``req`` until the server reports it durable."""
        self.prune(durable)
        if req.seq > durable:
            if not req.owned and req.payload is not None:
                req.payload, req.owned, req.wire = req.payload.clone(), True, None
            req.future, req.on_reply, req.deadline = None, None, float("inf")
            self.retained[req.seq] = req


def refused_error(address: str, had_secret: bool) -> AuthenticationError:
    have = "this secret" if had_secret else "no secret"
    return AuthenticationError(
        f"parameter server {address} refused this client's hello: it was sent "
        f"with {have}, which the server does not accept\n- help: give the server's "
        "shared secret (the same text as its --secret-file; surrounding whitespace "
        "is stripped on both sides), or none if the server has none"
    )


def closed_error(address: str) -> ClosedError:
    return ClosedError(
        f"parameter server {address} shut down (it keeps no checkpoint to "
        "restart from, so its values are gone)"
    )


def dealer(ctx: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
    """A DEALER connected to ``address``: no linger, no high-water marks (the
    channel bounds what is in flight), reconnecting within 0.1-1 s;
    :class:`~gradhub.errors.InvalidOptionError` (a ``ValueError``) naming an
    address ZeroMQ refuses."""
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = 0
    sock.rcvhwm = 0
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    try:
        sock.connect(address)
    except zmq.ZMQError as exc:
        sock.close(0)
        raise zmq_errors.translate(exc, endpoint=address, action="connect") from exc
    return sock
