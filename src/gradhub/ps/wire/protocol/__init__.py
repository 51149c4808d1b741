"""The parameter-server wire format: one fixed header, the key, raw tensor bytes.

A message is four ZeroMQ frames, plus a fifth when a shared secret is set::

    [header (HEADER_SIZE bytes)] [key (UTF-8)] [meta (JSON or empty)]
    [payload (raw tensor bytes)] [HMAC-SHA256]

or, *packed* (``FLAG_PACKED``), the same bytes one after the other in a single
frame: what the sockets send when the payload frame holds at most
:data:`PACK_MAX` bytes (``encode(..., pack=True)``). Each frame of a message
costs ZeroMQ and pyzmq a send and a receive on both sides, several times the
cost of copying a few kilobytes, so small messages travel as one frame; a
larger payload keeps its own frame, sent without a copy. The meta's length is
what the header's key and payload lengths (and the MAC) leave of the frame.

``meta`` is small JSON for what the fixed header cannot hold: the optimizer
spec of an ``init``, the hyperparameters of a ``push``; empty for most messages.

The header is a little-endian ``struct`` (see ``_HEADER``): magic ``b"GH"``,
protocol version, op, flags, status, dtype code, codec code, ndim, key length,
worker id, priority, request id, session, sequence number, server
incarnation, one auxiliary field, payload length and up to ``MAX_NDIM``
dimensions. Tensor bytes travel as their own frame: :func:`encode` hands
ZeroMQ a view of the tensor's memory and :func:`Message.tensor` wraps a
received frame with ``torch.frombuffer``, so neither side copies them.

With ``FLAG_ARENA`` the payload frame is an :data:`ARENA_LOCATOR` (segment,
offset, length) naming bytes in a shared-memory arena of the two peers
(:mod:`gradhub.ps.wire.arena`); the HMAC then covers those bytes in place of the
frame's, so a signed message signs the payload wherever it travels.

The HMAC covers header, key, meta and payload frames; it is checked with
``hmac.compare_digest``. :func:`decode` checks everything that can be checked
(magic, version, op, sizes, dtype, shape against payload length, UTF-8 key,
signature) and raises only :class:`~gradhub.errors.ProtocolError` (or its
subclass :class:`~gradhub.errors.AuthenticationError`) for any input.

Decisions:
- A signed frame sent to an endpoint without a secret is refused as well: a
  secret configured on one side only is a mistake worth surfacing.
- Replies use the request's op with ``FLAG_REPLY`` set and a :class:`Status`;
  an error reply carries its message as UTF-8 in the payload.
- A server refuses a hello it cannot authenticate with a fixed, *unsigned*
  reply of status ``REFUSED`` (it has no shared key with that peer);
  :func:`refusal_request_id` lets a client recognise one.

Modules: :mod:`.message` (ops, statuses, :class:`Header`, :class:`Message`,
dtype and codec codes) and :mod:`.framing` (:func:`encode`, :func:`decode`,
signing, packing); this package re-exports both.
"""

from gradhub.ps.wire.protocol.framing import (
    HEADER_SIZE,
    decode,
    encode,
    peek_header,
    refusal_request_id,
)
from gradhub.ps.wire.protocol.message import (
    ARENA_LOCATOR,
    CODECS,
    DEFAULT_MAX_PAYLOAD,
    FLAG_ARENA,
    FLAG_MAC,
    FLAG_PACKED,
    FLAG_REPLY,
    MAC_SIZE,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_META_BYTES,
    MAX_NDIM,
    MUTATING,
    PACK_MAX,
    VERSION,
    ArenaResolver,
    Header,
    Message,
    Op,
    Status,
    dtype_code,
    dtype_of,
    reply,
    tensor_frame,
)

__all__ = [
    "ARENA_LOCATOR",
    "CODECS",
    "DEFAULT_MAX_PAYLOAD",
    "FLAG_ARENA",
    "FLAG_MAC",
    "FLAG_PACKED",
    "FLAG_REPLY",
    "HEADER_SIZE",
    "MAC_SIZE",
    "MAGIC",
    "MAX_KEY_BYTES",
    "MAX_META_BYTES",
    "MAX_NDIM",
    "MUTATING",
    "PACK_MAX",
    "VERSION",
    "ArenaResolver",
    "Header",
    "Message",
    "Op",
    "Status",
    "decode",
    "dtype_code",
    "dtype_of",
    "encode",
    "peek_header",
    "refusal_request_id",
    "reply",
    "tensor_frame",
]
