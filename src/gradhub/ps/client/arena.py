"""The client's side of the arena with one server: its segments, its Unix
connection, and what a request becomes through them (:mod:`gradhub.ps.wire.arena`)."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import mmap
import os
import select
import socket
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gradhub._shm.hosts import host_identity
from gradhub._shm.memory import Mapping, new_segment
from gradhub.errors import ProtocolError, WorkerFailedError
from gradhub.ps.client.shared_tensors import SharedTensors
from gradhub.ps.wire.arena import (
    BYE,
    CANCEL,
    CANCELLED,
    CREDS,
    FORGET,
    ID,
    NEW,
    REGISTER,
    RID,
    SEGMENT,
    registration_mac,
)
from gradhub.ps.wire.protocol import ARENA_LOCATOR, MUTATING, Message, Op
from gradhub.trees import all_finite, copy_finite

__all__ = ["DEFAULT_CACHE_BYTES", "DEFAULT_MIN_BYTES", "ClientArena", "Slot"]

log = logging.getLogger(__name__)

DEFAULT_MIN_BYTES = 64 << 10
"""Payloads below this many bytes keep the ZeroMQ path (a copy costs less than the bookkeeping)."""
DEFAULT_CACHE_BYTES = 256 << 20
"""Free segments a client keeps per server for reuse."""


def _round_up(n: int) -> int:
    page = mmap.PAGESIZE
    return max(page, (n + page - 1) // page * page)


@dataclass(eq=False)
class Slot:
    """One segment of a client's arena, lent to one request at a time."""

    id: int
    size: int
    mapping: Mapping

    def tensor(self, like: torch.Tensor) -> torch.Tensor:
        """A view of the segment's first bytes with ``like``'s dtype and shape."""
        assert self.mapping.bytes is not None
        n = like.numel() * like.element_size()
        return self.mapping.bytes[:n].view(like.dtype).view(like.shape)

    def locator(self, nbytes: int) -> bytes:
        return ARENA_LOCATOR.pack(self.id, 0, nbytes)


class Request(Protocol):
    """A client request as the arena reads and lends to it (:class:`gradhub.ps.client.link.Request`
    is one). Structural, so the arena does not import the client's link (which holds
    a :class:`ClientArena`): no import circle."""

    op: Op
    payload: torch.Tensor | None
    meta: bytes
    nbytes: int
    reply_bytes: int
    sends: int
    slot: Slot | None
    into: torch.Tensor | None  # a pull's destination (its first tensor's part)
    named_user: bool  # a send named a user's tensor (a pull, answered in place)


class ClientArena:
    """A client's arena with one server: its segments and its Unix connection.

    Created from the server's hello reply (``info``); used by the client's I/O
    thread only. Raises ``OSError`` when the server cannot be reached.
    ``shared``: the client's user tensors (:mod:`gradhub.ps.client.shared_tensors`),
    handed to this server the first time a request names one.
    """

    def __init__(
        self,
        info: dict[str, Any],
        *,
        session: int,
        worker_id: int,
        secret: bytes | None,
        timeout: float,
        min_bytes: int = DEFAULT_MIN_BYTES,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        shared: SharedTensors | None = None,
    ) -> None:
        self.min_bytes = max(1, min_bytes)
        self.cache_bytes = cache_bytes
        self.restartable = bool(info.get("restartable"))
        self.said_bye = False
        self._slots: dict[int, Slot] = {}
        self._free: list[Slot] = []
        self._ids = itertools.count(1)
        self._shared = shared
        self._user: set[int] = set()  # ids of the user segments this server maps
        self.confirmed: list[int] = []  # request ids whose cancel the server confirmed
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect("\0" + str(info["socket"]))
            pid, _, _ = CREDS.unpack(
                self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, CREDS.size)
            )
            self.server_pid = pid
            register: dict[str, Any] = {"session": session, "worker": worker_id}
            if secret:
                nonce = bytes.fromhex(str(info["nonce"]))
                register["mac"] = registration_mac(secret, nonce, session, worker_id)
            self._sock.send(REGISTER + json.dumps(register).encode())
        except (OSError, KeyError, ValueError) as exc:
            self._sock.close()
            raise OSError(f"shared arena unavailable: {exc}") from exc
        self._readable = select.poll()
        self._readable.register(self._sock.fileno(), select.POLLIN)
        if shared is not None:
            shared.listen(self)

    @staticmethod
    def offered(info: dict[str, Any]) -> bool:
        """Whether a server's hello ``info`` offers an arena on this client's host."""
        return bool(info.get("socket")) and info.get("host") == host_identity()

    @classmethod
    def connect(
        cls,
        hello: Message,
        address: str,
        *,
        session: int,
        worker_id: int,
        secret: bytes | None,
        timeout: float,
        min_bytes: int,
        shared: SharedTensors | None = None,
    ) -> ClientArena | None:
        """The arena a server's hello reply offers, if this host is the server's;
        ``None`` when it offers none here or the set-up fails (logged)."""
        if not hello.payload:
            return None
        try:
            info = json.loads(hello.text())
            if not isinstance(info, dict) or not cls.offered(info):
                return None
            arena = cls(
                info,
                session=session,
                worker_id=worker_id,
                secret=secret,
                timeout=timeout,
                min_bytes=min_bytes,
                shared=shared,
            )
        except (OSError, ValueError) as exc:
            log.info("no shared arena with %s: %s", address, exc)
            return None
        log.debug("shared arena with %s (pid %d)", address, arena.server_pid)
        return arena

    def fileno(self) -> int:
        return self._sock.fileno()

    def take(self, nbytes: int) -> Slot:
        """A segment of at least ``nbytes`` for one request (a free one, or a new one
        handed to the server before this returns)."""
        fits = [s for s in self._free if nbytes <= s.size <= 4 * max(nbytes, self.min_bytes)]
        if fits:
            slot = min(fits, key=lambda s: s.size)
            self._free.remove(slot)
            return slot
        size = _round_up(nbytes)
        while self._free and self._cached() + size > self.cache_bytes:
            self._retire(self._free.pop(0))
        sid = next(self._ids)
        fd = new_segment(size, "gradhub-ps")
        try:
            socket.send_fds(self._sock, [NEW + SEGMENT.pack(sid, size)], [fd])
        except BaseException:
            os.close(fd)
            raise
        slot = Slot(sid, size, Mapping(fd, size))
        self._slots[sid] = slot
        return slot

    def holds(self, slot: Slot) -> bool:
        return self._slots.get(slot.id) is slot

    def give_back(self, slot: Slot, *, reuse: bool) -> None:
        """Return ``slot`` after its request is answered or dropped; ``reuse`` only
        if the request was sent once (else the server may still touch it)."""
        if not self.holds(slot):
            return
        if reuse and self._cached() + slot.size <= self.cache_bytes:
            self._free.append(slot)
        else:
            self._retire(slot)

    def carry(self, req: Request) -> tuple[torch.Tensor | None, bytes, bytes | None]:
        """(payload, meta, locator) of ``req`` through this arena: a push's tensor is
        copied into a segment (once: a retry finds it there); a pull names the
        segment its reply goes into. Small requests pass unchanged."""
        if req.slot is not None and not self.holds(req.slot):
            req.slot = None  # lent by an arena that is gone
        if req.payload is not None and req.nbytes >= self.min_bytes and req.op in MUTATING:
            if req.slot is None:
                place = self._place(req.payload)  # a user's tensor: read where it lies
                if place is not None:
                    return req.payload, req.meta, ARENA_LOCATOR.pack(*place, req.nbytes)
                req.slot = self.take(req.nbytes)
                req.slot.tensor(req.payload).copy_(req.payload)
            return req.slot.tensor(req.payload), req.meta, req.slot.locator(req.nbytes)
        if req.op == Op.PULL and req.reply_bytes >= self.min_bytes:
            # Only a first send names a user's tensor: the server writes into it at most
            # once, for that send; a retry or a replay goes through a private segment.
            into = req.into
            place = None if req.sends != 1 or into is None else self._place(into)
            if place is not None and into is not None:
                req.named_user = True
                expect = [str(into.dtype), into.numel()]
                where = {"arena": [*place, req.reply_bytes], "expect": expect}
                return None, json.dumps(where).encode(), None
            if req.slot is None:
                req.slot = self.take(req.reply_bytes)
            where = {"arena": [req.slot.id, 0, req.reply_bytes]}
            return None, json.dumps(where).encode(), None
        return req.payload, req.meta, None

    def _place(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(segment id, offset) of a user's tensor ``t``, its segment handed to this
        server first if it has not seen it; ``None`` for any other tensor."""
        if self._shared is None:
            return None
        for sid in self._shared.freed(self):
            if sid in self._user:
                self._user.discard(sid)
                with contextlib.suppress(OSError):
                    self._sock.send(FORGET + ID.pack(sid), socket.MSG_DONTWAIT)
        found = self._shared.find(t)
        if found is None:
            return None
        seg, offset = found
        if seg.id not in self._user:
            if seg.fd < 0:
                return None
            socket.send_fds(self._sock, [NEW + SEGMENT.pack(seg.id, seg.size)], [seg.fd])
            self._user.add(seg.id)
        return seg.id, offset

    def stage(self, req: Request) -> bool:
        """Copy a push's payload into a segment now (:meth:`carry` then sends it from
        there) and tell whether it holds no NaN or infinity
        (:func:`gradhub.trees.copy_finite`: a large one is read once for both)."""
        assert req.payload is not None
        if self._shared is not None and self._shared.find(req.payload) is not None:
            return all_finite(req.payload)  # a user's tensor: sent from where it lies
        req.slot = self.take(req.nbytes)
        return copy_finite(req.slot.tensor(req.payload), req.payload)

    def release(self, req: Request, *, answered: bool = True) -> None:
        """Take back ``req``'s segment once the server is done with it; reused only
        after an answer to a request sent once (else the server may still touch it)."""
        if req.slot is not None:
            self.give_back(req.slot, reuse=answered and req.sends == 1)
            req.slot = None

    def cancel(self, request_id: int) -> None:
        """Ask the server not to write into a user's tensor for ``request_id``; it
        confirms (:attr:`confirmed`, filled by :meth:`alive`)."""
        self._sock.send(CANCEL + RID.pack(request_id), socket.MSG_DONTWAIT)

    def resolve(self, session: int, locator: bytes) -> memoryview:
        """The bytes a reply's locator names in one of this client's segments."""
        sid, offset, length = ARENA_LOCATOR.unpack(locator)
        slot = self._slots.get(sid)
        if slot is None and sid in self._user and self._shared is not None:
            seg = self._shared.by_id(sid)
            view = None if seg is None else seg.view(offset, length)
            if view is not None:
                return view  # a pull answered in the user's tensor
        if slot is None or offset + length > slot.size:
            raise ProtocolError(f"a reply names arena bytes this client does not hold ({sid})")
        return memoryview(slot.mapping.mm)[offset : offset + length]

    def alive(self) -> bool:
        """Read what the server sent; ``False`` once the connection has ended."""
        # Asked first: the socket has a timeout (for its sends), so a receive that
        # finds nothing would wait for it instead of failing at once.
        while self._readable.poll(0):
            try:
                data = self._sock.recv(16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            if data == BYE:
                self.said_bye = True
            elif data[:1] == CANCELLED and len(data) == 1 + RID.size:
                self.confirmed.append(RID.unpack(data[1:])[0])
        return True

    def ended(self, address: str, timeout: float) -> WorkerFailedError | None:
        """Once the connection has ended (:meth:`alive` said so): the error that fails
        the requests to the server at ``address``; ``None`` when the server said
        goodbye or restarts from its checkpoint (the client then waits for it, up
        to ``timeout`` per request)."""
        if self.said_bye:
            return None  # the server closed: its goodbye on ZeroMQ says what follows
        if self.restartable:
            log.warning(
                "parameter server %s (pid %d) died; waiting for it to restart from its "
                "checkpoint (up to %gs per request)",
                address,
                self.server_pid,
                timeout,
            )
            return None
        return WorkerFailedError(
            f"parameter server {address} (pid {self.server_pid}) died: its process "
            "ended without closing, and it keeps no checkpoint to restart from"
        )

    def close(self, linger: float = 5.0) -> None:
        """Unmap the private segments and end the connection. If the server maps user
        tensors, wait (up to ``linger`` seconds) until it has ended its side too:
        from then on it cannot write into them (it ends it from its loop, between
        requests). Past ``linger`` that is logged."""
        for slot in self._slots.values():
            slot.mapping.close()
        self._slots.clear()
        self._free.clear()
        if self._shared is not None:
            self._shared.unlisten(self)
        if self._user:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)
                if not self._server_gone(linger):
                    log.warning(
                        "parameter server (pid %d) did not release this client's shared "
                        "tensors within %gs: it may still write into one it was answering",
                        self.server_pid,
                        linger,
                    )
        self._sock.close()

    def _server_gone(self, linger: float) -> bool:
        """Read until the server's end of the connection closes, up to ``linger``."""
        poll = select.poll()
        poll.register(self._sock.fileno(), select.POLLIN)
        deadline = time.monotonic() + linger
        while (left := deadline - time.monotonic()) > 0:
            if not poll.poll(left * 1000):
                return False
            try:
                if not self._sock.recv(64, socket.MSG_DONTWAIT):
                    return True
            except BlockingIOError:
                continue
        return False

    def _cached(self) -> int:
        return sum(s.size for s in self._free)

    def _retire(self, slot: Slot) -> None:
        del self._slots[slot.id]
        slot.mapping.close()
        with contextlib.suppress(OSError):
            self._sock.send(FORGET + ID.pack(slot.id), socket.MSG_DONTWAIT)
