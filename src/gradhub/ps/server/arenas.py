"""The server's side of the arena: the Unix listener, and the segments each client
on its host handed over (:mod:`gradhub.ps.wire.arena`)."""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from gradhub._shm.hosts import host_identity
from gradhub._shm.memory import Mapping
from gradhub.errors import ProtocolError
from gradhub.ps.wire.arena import (
    BYE,
    CANCEL,
    CANCELLED,
    CREDS,
    FIRST_SHARED_ID,
    FORGET,
    ID,
    NEW,
    REGISTER,
    RID,
    SEGMENT,
    registration_mac,
)
from gradhub.ps.wire.protocol import ARENA_LOCATOR

__all__ = ["ServerArenas"]

log = logging.getLogger(__name__)

_MAX_CONTROL = 4096
_MAX_CANCELLED = 4096  # cancels kept per client whose pull has not arrived (lost ones)


@dataclass(eq=False)
class _Peer:
    sock: socket.socket
    pid: int
    session: int = 0
    worker: int = -1
    segments: dict[int, Mapping] | None = None
    cancelled: dict[int, None] = field(default_factory=dict)  # request ids, oldest first


class ServerArenas:
    """A server's side: the Unix listener and the segments of every client on its host.

    Used by the server's loop thread only. :meth:`attach` registers its sockets
    in the loop's poller; :meth:`ready` handles what the poller reported.
    """

    def __init__(self, secret: bytes | None, *, restartable: bool, max_segment: int) -> None:
        self._secret = secret
        self._restartable = restartable
        self._max_segment = max_segment
        self._name = f"gradhub-ps-{secrets.token_hex(12)}"
        self._nonce = secrets.token_bytes(16)
        self._listener = socket.socket(
            socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        )
        try:
            self._listener.bind("\0" + self._name)
            self._listener.listen(64)
        except OSError:
            self._listener.close()
            raise
        self._peers: dict[int, _Peer] = {}  # by socket fd
        self._sessions: dict[int, _Peer] = {}
        self._poller: zmq.Poller | None = None
        self.dropped = 0
        """Client connections ended (a client closed or died) or refused."""

    def info(self) -> dict[str, Any]:
        """What a hello reply tells a client: where to connect, and the nonce to sign."""
        return {
            "host": host_identity(),
            "socket": self._name,
            "nonce": self._nonce.hex(),
            "restartable": self._restartable,
        }

    @property
    def clients(self) -> int:
        return len(self._sessions)

    def attach(self, poller: zmq.Poller) -> None:
        self._poller = poller
        poller.register(self._listener.fileno(), zmq.POLLIN)
        for fd in self._peers:
            poller.register(fd, zmq.POLLIN)

    def ready(self, events: dict[Any, int]) -> None:
        """Accept new clients and read the ones with something to say."""
        if self._listener.fileno() in events:
            self._accept()
        for fd in [fd for fd in self._peers if fd in events]:
            self._read(self._peers[fd])

    def resolve(self, session: int, locator: bytes) -> memoryview:
        """The bytes a request's locator names in its client's segments."""
        segment = self._segment(session, ARENA_LOCATOR.unpack(locator))
        if segment is None:  # sent before the message: read what is waiting, then look again
            self._accept()
            for peer in list(self._peers.values()):
                self._read(peer)
            segment = self._segment(session, ARENA_LOCATOR.unpack(locator))
        if segment is None:
            raise ProtocolError(f"arena locator of session {session:#x} names no segment it holds")
        mapping, offset, length = segment
        return memoryview(mapping.mm)[offset : offset + length]

    def destination(
        self, session: int, meta: dict[str, Any], value: torch.Tensor, request_id: int
    ) -> tuple[bytes, torch.Tensor] | None:
        """Where a pull reply of ``value`` may go: (locator, uint8 view) in the segment
        the request named, or ``None`` (then the reply carries the bytes).

        A user's tensor (:mod:`gradhub.ps.client.shared_tensors`) is written into only if
        ``value`` has the dtype and element count the request expects (else the
        client raises without its tensor touched) and the client has not
        cancelled ``request_id``: its messages are read first, here, between
        requests, where a cancel is confirmed."""
        nbytes = value.numel() * value.element_size()
        where = meta.get("arena")
        if not (
            isinstance(where, list) and len(where) == 3 and all(isinstance(x, int) for x in where)
        ):
            return None
        sid, offset, capacity = where
        if nbytes > capacity or nbytes == 0:
            return None
        if sid >= FIRST_SHARED_ID:
            peer = self._sessions.get(session)
            if peer is None or meta.get("expect") != [str(value.dtype), value.numel()]:
                return None
            self._read(peer)  # a cancel, or the end of the connection, sent before now
            if request_id in peer.cancelled:
                del peer.cancelled[request_id]  # cancelled: the client no longer waits for it
                return None
        segment = self._segment(session, (sid, offset, nbytes))
        if segment is None:
            return None
        mapping = segment[0]
        assert mapping.bytes is not None
        return ARENA_LOCATOR.pack(sid, offset, nbytes), mapping.bytes[offset : offset + nbytes]

    def close(self) -> None:
        """Tell every client this server is closing (not dying), then release everything."""
        for peer in list(self._peers.values()):
            self._drop(peer, bye=True)
        self._listener.close()

    # ---------------------------------------------------------------- helpers
    def _segment(self, session: int, loc: tuple[int, int, int]) -> tuple[Mapping, int, int] | None:
        peer = self._sessions.get(session)
        if peer is None or peer.segments is None:
            return None
        sid, offset, length = loc
        mapping = peer.segments.get(sid)
        if mapping is None or offset < 0 or offset + length > mapping.size:
            return None
        return mapping, offset, length

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("arena accept failed: %s", exc)
                return
            pid, uid, _ = CREDS.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, CREDS.size)
            )
            if uid != os.getuid():
                log.warning("refused a shared-arena connection from pid %d of user %d", pid, uid)
                conn.close()
                self.dropped += 1
                continue
            conn.setblocking(False)
            peer = _Peer(conn, pid)
            self._peers[conn.fileno()] = peer
            if self._poller is not None:
                self._poller.register(conn.fileno(), zmq.POLLIN)

    def _read(self, peer: _Peer) -> None:
        while peer.sock.fileno() in self._peers:
            try:
                data, fds, _, _ = socket.recv_fds(peer.sock, _MAX_CONTROL, 4, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._drop(peer)
                return
            try:
                if not data:
                    self._drop(peer)  # the client closed or died: its memory is freed now
                    return
                self._message(peer, data, fds)
            except (ProtocolError, ValueError, OSError, struct.error) as exc:
                log.warning("dropped the shared arena of pid %d: %s", peer.pid, exc)
                self._drop(peer, bye=True)
                return
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def _message(self, peer: _Peer, data: bytes, fds: list[int]) -> None:
        kind, body = data[:1], data[1:]
        if kind == REGISTER and peer.segments is None:
            reg = json.loads(body)
            session, worker = int(reg["session"]), int(reg["worker"])
            if self._secret is not None:
                mac = registration_mac(self._secret, self._nonce, session, worker)
                if not hmac.compare_digest(mac, str(reg.get("mac", ""))):
                    raise ProtocolError("registration not signed with this server's secret")
            old = self._sessions.get(session)
            if old is not None:
                self._drop(old, bye=True)
            peer.session, peer.worker, peer.segments = session, worker, {}
            self._sessions[session] = peer
        elif kind == NEW and peer.segments is not None and len(fds) == 1:
            sid, size = SEGMENT.unpack(body)
            if not 0 < size <= self._max_segment:
                raise ProtocolError(f"segment of {size} bytes exceeds the payload limit")
            fd = fds.pop()
            peer.segments[sid] = Mapping(fd, size)  # closes fd
        elif kind == CANCEL and peer.segments is not None:
            (rid,) = RID.unpack(body)
            peer.cancelled[rid] = None
            while len(peer.cancelled) > _MAX_CANCELLED:
                del peer.cancelled[next(iter(peer.cancelled))]
            with contextlib.suppress(OSError):  # lost: the client fails the pull later
                peer.sock.send(CANCELLED + body, socket.MSG_DONTWAIT)
        elif kind == FORGET and peer.segments is not None:
            (sid,) = ID.unpack(body)
            mapping = peer.segments.pop(sid, None)
            if mapping is not None:
                mapping.close()
        else:
            raise ProtocolError(f"unexpected arena message {kind!r}")

    def _drop(self, peer: _Peer, *, bye: bool = False) -> None:
        fd = peer.sock.fileno()
        self._peers.pop(fd, None)
        if self._sessions.get(peer.session) is peer:
            del self._sessions[peer.session]
        if self._poller is not None:
            self._poller.unregister(fd)
        for mapping in (peer.segments or {}).values():
            mapping.close()
        peer.segments = None
        if bye:
            with contextlib.suppress(OSError):
                peer.sock.send(BYE, socket.MSG_DONTWAIT)
        peer.sock.close()
        self.dropped += 1
