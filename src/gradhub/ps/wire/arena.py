"""Same-host payloads of the parameter server: a shared arena beside ZeroMQ.

When a client and a server share a host (:func:`gradhub._shm.hosts.host_identity`:
hostname, boot id and network namespace), tensor payloads of at least
``min_bytes`` do not travel through ZeroMQ. They lie in anonymous ``memfd``
segments (:mod:`gradhub._shm.memory`) that the client creates and
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

A segment is reused only after the answer to a request that was sent once: a
request sent again (a retry, a replay after a restart) may still be read or
answered by the server from its first copy, and one given up (its deadline)
may still be answered, so its segment is retired instead. Free segments are
kept up to ``cache_bytes`` per server.

The user's own tensors (:mod:`~gradhub.ps.client.shared_tensors`:
:meth:`~gradhub.RemoteParameterServer.empty_like`, ``shared_like``): segments
the client lends its user, one per tensor, handed to each server the first
time a request names one. A push of such a tensor sends its locator (no copy:
the server's update reads it where it lies); a pull names it, and the server
writes the value into it (one copy, the server's). Why that stays exact:

- A push: the tensor is read until its future is done (the user's rule). A
  retry names it again (unchanged by that rule); a copy that arrives after the
  answer is a duplicate (exactly once: not applied). A push acknowledged but
  not on disk is kept as a copy (:meth:`gradhub.ps.client.link.Link.retain`), so a
  replay after a restart never reads the tensor, which may have changed.
- A pull: only its first send names the tensor; retries and replays name a
  private segment and the client copies from it. The server answers one
  connection's requests on one key in the order they came, so the first send
  is answered (written) before any retry: once any answer reached the client,
  no later write into the tensor follows. The server writes only if the value
  has the dtype and element count the request states (else the client raises
  with the tensor untouched).
- A pull given up at its deadline may still be queued on the server. The
  client sends ``C`` (cancel) on the Unix socket and fails the pull only once
  the server answers ``c``, which it does from its loop, between requests;
  before writing into a user's tensor the server reads that socket and skips a
  cancelled request. (The two channels are not ordered: a pull answered just
  before the server read the cancel fails too, its value already written; no
  write follows the confirmation.) A server whose process ended cannot write;
  one that confirms nothing within another timeout fails the pull with a
  message that the tensor may still change.
- Closing: the client half-closes each connection that lent user tensors and
  waits (up to 5 s) until the server, from its loop, has ended its side and
  unmapped them; the tensors then stay mapped in the client, ordinary memory.
- With a shared secret the signature covers the tensor's bytes, as it covers a
  private segment's (the server checks it on the bytes it then reads).

Security decisions: the Unix socket accepts only processes of the server's
user (``SO_PEERCRED``). With a shared secret, a client registers its arena
with an HMAC of the server's nonce (from the signed hello reply) and its
session, and every message's HMAC covers the arena bytes exactly as it covers
a payload frame (:func:`gradhub.ps.wire.protocol.encode`): the server checks the
signature on the bytes it then reads, so the arena carries nothing the secret
did not sign. Only the client that signed and the server map a segment.

Off switch: ``GRADHUB_PS_ARENA=0`` in the environment of a client or a server,
``RemoteParameterServer(arena=False)``, ``ServerConfig(arena=False)``
(``gradhub serve --no-arena``). Without ``memfd_create`` or ``send_fds``
(not Linux), on different hosts, or when the set-up fails, payloads take
the ZeroMQ path as before.

Modules: this one, what both sides share (the switch, the Unix connection's
messages, the registration's signature); the client's side,
:mod:`gradhub.ps.client.arena` (:class:`~gradhub.ps.client.arena.ClientArena`,
:class:`~gradhub.ps.client.arena.Slot`) and
:mod:`gradhub.ps.client.shared_tensors` (the user's tensors); the server's,
:mod:`gradhub.ps.server.arenas` (:class:`~gradhub.ps.server.arenas.ServerArenas`).

The Unix connection's messages: one ``SOCK_SEQPACKET`` packet each, a kind
byte, then its body. ``R`` registers the client (JSON: session, worker, and
with a shared secret the MAC of :func:`registration_mac`); ``S`` hands a
segment over (id and size, its descriptor beside); ``F`` forgets one (id);
``B`` is the server's goodbye. ``C`` cancels a pull into a user's tensor (its
request id): the server will not write into that tensor for it, and confirms
with ``c`` (the same id) from its loop, so never while it is writing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct

from gradhub._shm.memory import supported

__all__ = [
    "ARENA_ENV",
    "BYE",
    "CANCEL",
    "CANCELLED",
    "CREDS",
    "FIRST_SHARED_ID",
    "FORGET",
    "ID",
    "NEW",
    "REGISTER",
    "RID",
    "SEGMENT",
    "enabled",
    "registration_mac",
]

ARENA_ENV = "GRADHUB_PS_ARENA"

FIRST_SHARED_ID = 1 << 31
"""Segment ids of user tensors start here; a client's private segments stay below."""

SEGMENT = struct.Struct("<IQ")  # id, size
ID = struct.Struct("<I")
RID = struct.Struct("<Q")  # a request id
CREDS = struct.Struct("3i")  # pid, uid, gid
REGISTER, NEW, FORGET, BYE, CANCEL, CANCELLED = b"R", b"S", b"F", b"B", b"C", b"c"


def enabled(option: bool | None = None) -> bool:
    """Whether the arena may be used: the option if given, else ``GRADHUB_PS_ARENA``
    (``0``, ``off``, ``false`` or ``no`` turn it off), and the platform has it."""
    if option is None:
        option = os.environ.get(ARENA_ENV, "1").strip().lower() not in ("0", "off", "false", "no")
    return option and supported()


def registration_mac(secret: bytes, nonce: bytes, session: int, worker: int) -> str:
    data = b"gradhub-ps-arena" + nonce + struct.pack("<QI", session, worker)
    return hmac.new(secret, data, hashlib.sha256).hexdigest()
