"""Same-host payloads of the parameter server: a shared arena beside ZeroMQ.

When a client and a server share a host (:func:`gradhub.collective.hosts.host_identity`:
hostname, boot id and network namespace), tensor payloads of at least
``min_bytes`` do not travel through ZeroMQ. They lie in anonymous ``memfd``
segments (:mod:`gradhub.collective.shm_memory`) that the client creates and
hands to the server over a Unix socket (``socket.send_fds``, abstract name),
and the ZeroMQ message carries a locator (segment, offset, length) in place of
the bytes. ZeroMQ still carries every request and reply, their signatures and
their order.

- Push and init: the client copies the tensor into one of its segments; the
  server reads it where it lies (a view, no copy) and applies it.
- Pull: the request names a segment of the client's; the server copies the
  value into it and answers with its locator; the client copies it into the
  worker's tensors.

Lifetime: the client owns every segment (creates, reuses, retires it); the
server maps the segments a client sends and unmaps them when that client's
Unix connection ends, so a killed client's memory is freed at once, and a
killed server's mappings end with its process. Nothing is named, so nothing
is left behind. A server that closes says so on the connection first; a
client that sees the connection end without it knows the server process died.

A segment is reused only after a request that was sent once: a request sent
again (a retry, a replay after a restart) may still be read or answered by the
server from its first copy, so its segment is retired instead. Free segments
are kept up to ``cache_bytes`` per server.

Security decisions: the Unix socket accepts only processes of the server's
user (``SO_PEERCRED``). With a shared secret, a client registers its arena
with an HMAC of the server's nonce (from the signed hello reply) and its
session, and every message's HMAC covers the arena bytes exactly as it covers
a payload frame (:func:`gradhub.ps.protocol.encode`): the server checks the
signature on the bytes it then reads, so the arena carries nothing the secret
did not sign. Only the client that signed and the server map a segment.

Off switch: ``GRADHUB_PS_ARENA=0`` in the environment of a client or a server,
``RemoteParameterServer(arena=False)``, ``ServerConfig(arena=False)``
(``gradhub serve --no-arena``). Without ``memfd_create`` or ``send_fds``
(not Linux), on different hosts, or when the set-up fails, payloads take
the ZeroMQ path as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import mmap
import os
import secrets
import socket
import struct
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from gradhub.collective.hosts import host_identity
from gradhub.collective.shm_memory import Mapping, new_segment, supported
from gradhub.errors import ProtocolError
from gradhub.ps.protocol import ARENA_LOCATOR

__all__ = [
    "ARENA_ENV",
    "DEFAULT_CACHE_BYTES",
    "DEFAULT_MIN_BYTES",
    "ClientArena",
    "ServerArenas",
    "enabled",
]

log = logging.getLogger(__name__)

ARENA_ENV = "GRADHUB_PS_ARENA"
DEFAULT_MIN_BYTES = 64 << 10
"""Payloads below this many bytes keep the ZeroMQ path (a copy costs less than the bookkeeping)."""
DEFAULT_CACHE_BYTES = 256 << 20
"""Free segments a client keeps per server for reuse."""

_SEGMENT = struct.Struct("<IQ")  # id, size
_ID = struct.Struct("<I")
_CREDS = struct.Struct("3i")  # pid, uid, gid
_REGISTER, _NEW, _FORGET, _BYE = b"R", b"S", b"F", b"B"
_MAX_CONTROL = 4096


def enabled(option: bool | None = None) -> bool:
    """Whether the arena may be used: the option if given, else ``GRADHUB_PS_ARENA``
    (``0``, ``off``, ``false`` or ``no`` turn it off), and the platform has it."""
    if option is None:
        option = os.environ.get(ARENA_ENV, "1").strip().lower() not in ("0", "off", "false", "no")
    return option and supported()


def _registration_mac(secret: bytes, nonce: bytes, session: int, worker: int) -> str:
    data = b"gradhub-ps-arena" + nonce + struct.pack("<QI", session, worker)
    return hmac.new(secret, data, hashlib.sha256).hexdigest()


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


class ClientArena:
    """A client's arena with one server: its segments and its Unix connection.

    Created from the server's hello reply (``info``); used by the client's I/O
    thread only. Raises ``OSError`` when the server cannot be reached.
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
    ) -> None:
        self.min_bytes = max(1, min_bytes)
        self.cache_bytes = cache_bytes
        self.restartable = bool(info.get("restartable"))
        self.said_bye = False
        self._slots: dict[int, Slot] = {}
        self._free: list[Slot] = []
        self._ids = itertools.count(1)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect("\0" + str(info["socket"]))
            pid, _, _ = _CREDS.unpack(
                self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
            )
            self.server_pid = pid
            register: dict[str, Any] = {"session": session, "worker": worker_id}
            if secret:
                nonce = bytes.fromhex(str(info["nonce"]))
                register["mac"] = _registration_mac(secret, nonce, session, worker_id)
            self._sock.send(_REGISTER + json.dumps(register).encode())
        except (OSError, KeyError, ValueError) as exc:
            self._sock.close()
            raise OSError(f"shared arena unavailable: {exc}") from exc

    @staticmethod
    def offered(info: dict[str, Any]) -> bool:
        """Whether a server's hello ``info`` offers an arena on this client's host."""
        return bool(info.get("socket")) and info.get("host") == host_identity()

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
            socket.send_fds(self._sock, [_NEW + _SEGMENT.pack(sid, size)], [fd])
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

    def resolve(self, session: int, locator: bytes) -> memoryview:
        """The bytes a reply's locator names in one of this client's segments."""
        sid, offset, length = ARENA_LOCATOR.unpack(locator)
        slot = self._slots.get(sid)
        if slot is None or offset + length > slot.size:
            raise ProtocolError(f"a reply names arena bytes this client does not hold ({sid})")
        return memoryview(slot.mapping.mm)[offset : offset + length]

    def alive(self) -> bool:
        """Read what the server sent; ``False`` once the connection has ended."""
        while True:
            try:
                data = self._sock.recv(16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return True
            except OSError:
                return False
            if not data:
                return False
            if data == _BYE:
                self.said_bye = True

    def close(self) -> None:
        for slot in self._slots.values():
            slot.mapping.close()
        self._slots.clear()
        self._free.clear()
        self._sock.close()

    def _cached(self) -> int:
        return sum(s.size for s in self._free)

    def _retire(self, slot: Slot) -> None:
        del self._slots[slot.id]
        slot.mapping.close()
        with contextlib.suppress(OSError):
            self._sock.send(_FORGET + _ID.pack(slot.id), socket.MSG_DONTWAIT)


@dataclass(eq=False)
class _Peer:
    sock: socket.socket
    pid: int
    session: int = 0
    worker: int = -1
    segments: dict[int, Mapping] | None = None


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
        self, session: int, meta: dict[str, Any], nbytes: int
    ) -> tuple[bytes, torch.Tensor] | None:
        """Where a pull reply of ``nbytes`` may go: (locator, uint8 view) in the segment
        the request named, or ``None`` (then the reply carries the bytes)."""
        where = meta.get("arena")
        if not (
            isinstance(where, list) and len(where) == 3 and all(isinstance(x, int) for x in where)
        ):
            return None
        sid, offset, capacity = where
        if nbytes > capacity or nbytes == 0:
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
            pid, uid, _ = _CREDS.unpack(
                conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size)
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
        if kind == _REGISTER and peer.segments is None:
            reg = json.loads(body)
            session, worker = int(reg["session"]), int(reg["worker"])
            if self._secret is not None:
                mac = _registration_mac(self._secret, self._nonce, session, worker)
                if not hmac.compare_digest(mac, str(reg.get("mac", ""))):
                    raise ProtocolError("registration not signed with this server's secret")
            old = self._sessions.get(session)
            if old is not None:
                self._drop(old, bye=True)
            peer.session, peer.worker, peer.segments = session, worker, {}
            self._sessions[session] = peer
        elif kind == _NEW and peer.segments is not None and len(fds) == 1:
            sid, size = _SEGMENT.unpack(body)
            if not 0 < size <= self._max_segment:
                raise ProtocolError(f"segment of {size} bytes exceeds the payload limit")
            fd = fds.pop()
            peer.segments[sid] = Mapping(fd, size)  # closes fd
        elif kind == _FORGET and peer.segments is not None:
            (sid,) = _ID.unpack(body)
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
                peer.sock.send(_BYE, socket.MSG_DONTWAIT)
        peer.sock.close()
        self.dropped += 1
