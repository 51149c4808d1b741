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
(:mod:`gradhub.ps.arena`); the HMAC then covers those bytes in place of the
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
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import json
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradhub import codecs
from gradhub.errors import AuthenticationError, OversizedError, ProtocolError, UnknownOpError

MAGIC = b"GH"
VERSION = 2
MAX_NDIM = 8
MAX_KEY_BYTES = 1024
MAX_META_BYTES = 64 << 10
DEFAULT_MAX_PAYLOAD = 1 << 31  # 2 GiB
MAC_SIZE = 32

FLAG_REPLY = 1
FLAG_MAC = 2
FLAG_ARENA = 4  # the payload frame is a locator into a shared arena
FLAG_PACKED = 8  # header, key, meta, payload (and MAC) in one frame
_KNOWN_FLAGS = FLAG_REPLY | FLAG_MAC | FLAG_ARENA | FLAG_PACKED

PACK_MAX = 16 << 10
"""Largest payload frame a packed message holds (``encode(..., pack=True)``)."""

ARENA_LOCATOR = struct.Struct("<IQQ")
"""The payload frame of an arena message: segment id, byte offset, length."""

ArenaResolver = Callable[[int, bytes], memoryview]
"""``(session, locator) -> the bytes it names``; raises ``ProtocolError`` if it names none."""


_HEADER = struct.Struct("<2sBBHHBBBxHIiQQQQQQ" + "Q" * MAX_NDIM)
HEADER_SIZE = _HEADER.size


def _copied(flags: int) -> bool:
    return bool(flags & FLAG_PACKED) and not flags & FLAG_ARENA


class Op(enum.IntEnum):
    HELLO = 1  # register a worker (and learn the server's incarnation)
    HEARTBEAT = 2
    INIT = 3
    PUSH = 4
    PULL = 5
    STATS = 6
    SHUTDOWN = 7
    FLUSH = 8  # make everything acknowledged to this worker durable
    BYE = 9  # the server is going away (sent by the server, unrequested)
    STATE = 10  # read a key's optimizer state (gradhub.ps.optim_state)
    SET_STATE = 11  # replace a key's optimizer state


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN_KEY = 1
    DUPLICATE_KEY = 2
    SHAPE_MISMATCH = 3
    BAD_REQUEST = 4
    STALE_INCARNATION = 5  # the server restarted: say hello again, then resend
    SHUTTING_DOWN = 6
    INTERNAL = 7
    DTYPE_MISMATCH = 8
    OPTIMIZER_MISMATCH = 9
    NON_FINITE = 10
    REFUSED = 11  # authentication failed (an unsigned, fixed reply)
    TIMEOUT = 12  # a wait on the server (round, key not initialised yet) ran out


_OPS = {int(o): o for o in Op}  # a dict lookup costs a fraction of Op(code)
_STATUSES = {int(s): s for s in Status}

_DTYPES: dict[int, torch.dtype] = {
    1: torch.float32,
    2: torch.float64,
    3: torch.float16,
    4: torch.bfloat16,
    5: torch.int64,
    6: torch.int32,
    7: torch.int16,
    8: torch.int8,
    9: torch.uint8,
    10: torch.bool,
}
_DTYPE_CODES = {d: c for c, d in _DTYPES.items()}
_ITEMSIZE = {c: torch.empty((), dtype=d).element_size() for c, d in _DTYPES.items()}

CODECS = tuple(codecs.available())
"""Codec names by wire code: the one registry's order (:func:`gradhub.codecs.available`)."""
_CODEC_CODES = {name: i for i, name in enumerate(CODECS)}


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of ``dtype`` (``TypeError`` for dtypes the wire cannot carry)."""
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(
            f"dtype {dtype} cannot be sent to a parameter server; use one of "
            f"{', '.join(str(d) for d in _DTYPES.values())}"
        ) from None


def dtype_of(code: int) -> torch.dtype:
    """The dtype of a wire code (``ProtocolError`` for an unknown one)."""
    try:
        return _DTYPES[code]
    except KeyError:
        raise ProtocolError(f"unknown dtype code {code}") from None


@dataclass(slots=True)
class Header:
    """The fixed-size part of a message. ``dtype`` is ``None`` without a tensor."""

    op: Op
    request_id: int = 0
    worker_id: int = 0
    session: int = 0
    seq: int = 0
    incarnation: int = 0
    aux: int = 0
    priority: int = 0
    flags: int = 0
    status: Status = Status.OK
    dtype: torch.dtype | None = None
    codec: str = "none"
    shape: tuple[int, ...] = ()
    payload_len: int = 0

    @property
    def is_reply(self) -> bool:
        return bool(self.flags & FLAG_REPLY)


@dataclass(slots=True)
class Message:
    header: Header
    key: str
    payload: Any = field(default=b"")  # a buffer: bytes, memoryview or zmq.Frame
    meta: bytes = b""  # JSON text or empty
    routing: list[Any] = field(default_factory=list)  # ROUTER identity frames, if any

    def tensor(self) -> torch.Tensor:
        """The payload as a tensor of the header's dtype and shape, without a copy
        (read-only buffers such as ``bytes`` are copied first)."""
        h = self.header
        if h.dtype is None:
            raise ProtocolError(f"{h.op.name} message for key {self.key!r} carries no tensor")
        if h.payload_len == 0:
            return torch.empty(h.shape, dtype=h.dtype)
        if _copied(h.flags) or memoryview(self.payload).readonly:
            # Small (packed: it may lie at any alignment) or read-only (bytes): copied.
            # A ZeroMQ frame of its own or an arena's bytes are writable and never copied.
            return torch.frombuffer(bytearray(self.payload), dtype=h.dtype).view(h.shape)
        return torch.frombuffer(self.payload, dtype=h.dtype).view(h.shape)

    def meta_json(self) -> dict[str, Any]:
        """The meta frame as a JSON object (``{}`` when empty)."""
        if not self.meta:
            return {}
        try:
            data = json.loads(self.meta)
        except ValueError as exc:
            raise ProtocolError(f"meta of {self.key!r} is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ProtocolError(f"meta of {self.key!r} is not a JSON object")
        return data

    def text(self) -> str:
        """The payload as UTF-8 text (error replies)."""
        return bytes(memoryview(self.payload)).decode("utf-8", errors="replace")


def tensor_frame(tensor: torch.Tensor) -> memoryview | bytes:
    """A buffer over ``tensor``'s memory (contiguous CPU), for a zero-copy send.

    The buffer keeps the tensor alive; the caller must not modify the tensor
    until the send is done.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.numel() == 0:
        return b""
    t = t.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(t.numpy())  # type: ignore[arg-type]


def _mac(secret: bytes, parts: Sequence[Any]) -> bytes:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p)
    return h.digest()


def encode(
    header: Header,
    key: str = "",
    payload: torch.Tensor | bytes | memoryview | None = None,
    *,
    meta: bytes = b"",
    secret: bytes | None = None,
    arena: bytes | None = None,
    pack: bool = False,
) -> list[Any]:
    """The frames of one message (header, key, meta, payload[, mac]); fills in
    ``header``'s dtype, shape and payload length from a tensor payload.

    ``arena``: the locator of ``payload``, a tensor that lies in a shared arena;
    the locator travels instead of its bytes, which the signature still covers.
    ``pack``: one frame holding them all when the payload frame is at most
    :data:`PACK_MAX` bytes (the signature is the same: it covers the same bytes)."""
    key_bytes = key.encode("utf-8")
    if len(key_bytes) > MAX_KEY_BYTES:
        raise ValueError(
            f"key {key[:40]!r}... is {len(key_bytes)} bytes; the limit is {MAX_KEY_BYTES}"
        )
    if isinstance(payload, torch.Tensor):
        if payload.dim() > MAX_NDIM:
            raise ValueError(f"tensors of more than {MAX_NDIM} dimensions cannot be sent")
        header.dtype = payload.dtype
        header.shape = tuple(payload.shape)
        data: Any = tensor_frame(payload)
        header.payload_len = payload.numel() * payload.element_size()
    else:
        data = b"" if payload is None else payload
        header.payload_len = memoryview(data).nbytes
        header.dtype, header.shape = None, ()
    signed = data
    if arena is not None:
        data = arena
    packed = pack and memoryview(data).nbytes <= PACK_MAX
    flags = header.flags & ~FLAG_PACKED
    flags |= (FLAG_MAC if secret else 0) | (FLAG_ARENA if arena is not None else 0)
    flags |= FLAG_PACKED if packed else 0
    header.flags = flags
    shape = list(header.shape) + [0] * (MAX_NDIM - len(header.shape))
    head = _HEADER.pack(
        MAGIC,
        VERSION,
        int(header.op),
        flags,
        int(header.status),
        0 if header.dtype is None else dtype_code(header.dtype),
        _CODEC_CODES[header.codec],
        len(header.shape),
        len(key_bytes),
        header.worker_id,
        header.priority,
        header.request_id,
        header.session,
        header.seq,
        header.incarnation,
        header.aux,
        header.payload_len,
        *shape,
    )
    frames: list[Any] = [head, key_bytes, meta, data]
    if secret:
        frames.append(_mac(secret, frames if arena is None else [*frames, signed]))
    if packed:
        return [b"".join(frames)]
    return frames


def decode(
    frames: Sequence[Any],
    *,
    secret: bytes | None = None,
    max_payload: int = DEFAULT_MAX_PAYLOAD,
    arena: ArenaResolver | None = None,
) -> Message:
    """Parse and check one message; only ``ProtocolError`` escapes, whatever ``frames`` hold.

    ``arena`` finds the payload of a message that names one in a shared arena
    (a message that does, with no ``arena`` given, is malformed)."""
    try:
        return _decode(frames, secret, max_payload, arena)
    except ProtocolError:
        raise
    except Exception as exc:  # any other surprise is a malformed frame, never a crash
        raise ProtocolError(f"malformed message: {type(exc).__name__}: {exc}") from exc


def _decode(
    frames: Sequence[Any],
    secret: bytes | None,
    max_payload: int,
    arena: ArenaResolver | None = None,
) -> Message:
    if len(frames) not in (1, 4, 5):
        raise ProtocolError(f"expected 1, 4 or 5 frames, got {len(frames)}")
    if len(frames) == 1:
        views = _unpack(memoryview(frames[0]).cast("B"))
    else:
        views = [memoryview(f).cast("B") for f in frames]
    head = views[0]
    if head.nbytes != HEADER_SIZE:
        raise ProtocolError(f"header is {head.nbytes} bytes, expected {HEADER_SIZE}")
    fields = _HEADER.unpack(head)
    magic, version, op, flags, status, dcode, ccode, ndim, key_len = fields[:9]
    worker_id, priority, request_id, session, seq, incarnation, aux, payload_len = fields[9:17]
    dims = fields[17:]
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}; not a gradhub parameter-server message")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this is {VERSION})")
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"unknown flags {flags:#x}")
    signed = bool(flags & FLAG_MAC)
    if len(frames) > 1 and flags & FLAG_PACKED:
        raise ProtocolError(f"{len(frames)} frames, but the message says it is packed")
    if len(frames) > 1 and len(frames) != (5 if signed else 4):
        raise ProtocolError(f"{len(frames)} frames do not match the signature flag")
    if views[3].nbytes > max_payload:
        raise OversizedError(
            f"payload of {views[3].nbytes} bytes exceeds the limit of {max_payload}"
        )
    if views[2].nbytes > MAX_META_BYTES:
        raise OversizedError(f"meta of {views[2].nbytes} bytes exceeds {MAX_META_BYTES}")
    payload: Any = frames[3] if len(frames) > 1 else views[3]
    signed_parts = views[:4]
    if flags & FLAG_ARENA:
        if arena is None:
            raise ProtocolError("payload in a shared arena, but this connection has none")
        if views[3].nbytes != ARENA_LOCATOR.size:
            raise ProtocolError(f"arena locator is {views[3].nbytes} bytes")
        if payload_len > max_payload:
            raise OversizedError(
                f"payload of {payload_len} bytes exceeds the limit of {max_payload}"
            )
        payload = arena(session, views[3].tobytes())
        signed_parts = [*views[:4], payload]
        views[3] = payload
    if secret:
        if not signed:
            raise AuthenticationError("unsigned message; this endpoint requires a shared secret")
        expected = _mac(secret, signed_parts)
        if not hmac.compare_digest(expected, views[4].tobytes()):
            raise AuthenticationError("message signature does not match the shared secret")
    elif signed:
        raise AuthenticationError("signed message, but this endpoint has no shared secret")
    op_, status_ = _OPS.get(op), _STATUSES.get(status)
    if op_ is None or status_ is None:
        raise UnknownOpError(f"unknown op {op} or status {status}")
    if ccode >= len(CODECS):
        raise UnknownOpError(f"unknown codec code {ccode}")
    if key_len > MAX_KEY_BYTES or views[1].nbytes != key_len:
        raise ProtocolError(f"key frame is {views[1].nbytes} bytes, header says {key_len}")
    if payload_len > max_payload:
        raise OversizedError(f"payload of {payload_len} bytes exceeds the limit of {max_payload}")
    if views[3].nbytes != payload_len:
        raise ProtocolError(f"payload frame is {views[3].nbytes} bytes, header says {payload_len}")
    if ndim > MAX_NDIM:
        raise ProtocolError(f"ndim {ndim} exceeds {MAX_NDIM}")
    shape = tuple(dims[:ndim])
    if any(dims[ndim:]):
        raise ProtocolError("non-zero dimensions beyond ndim")
    dtype: torch.dtype | None = None
    if dcode:
        if dcode not in _DTYPES:
            raise UnknownOpError(f"unknown dtype code {dcode}")
        dtype = _DTYPES[dcode]
        if math.prod(shape) * _ITEMSIZE[dcode] != payload_len:
            raise ProtocolError(
                f"shape {list(shape)} of {dtype} does not match {payload_len} bytes"
            )
    elif ndim:
        raise ProtocolError("a shape without a dtype")
    try:
        key = views[1].tobytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("key is not valid UTF-8") from None
    header = Header(
        op=op_,
        request_id=request_id,
        worker_id=worker_id,
        session=session,
        seq=seq,
        incarnation=incarnation,
        aux=aux,
        priority=priority,
        flags=flags,
        status=status_,
        dtype=dtype,
        codec=CODECS[ccode],
        shape=shape,
        payload_len=payload_len,
    )
    return Message(header, key, payload, views[2].tobytes())


def _unpack(frame: memoryview) -> list[memoryview]:
    """The views of a packed frame as separate frames: header, key, meta, payload[, mac]
    (sizes from the header; what does not add up is left for the checks to refuse)."""
    if frame.nbytes < HEADER_SIZE:
        raise ProtocolError(f"packed frame of {frame.nbytes} bytes is shorter than a header")
    fields = _HEADER.unpack(frame[:HEADER_SIZE])
    flags, key_len, payload_len = fields[3], fields[8], fields[16]
    if not flags & FLAG_PACKED:
        raise ProtocolError("one frame, but the message is not packed")
    data_len = ARENA_LOCATOR.size if flags & FLAG_ARENA else payload_len
    mac_len = MAC_SIZE if flags & FLAG_MAC else 0
    meta_len = frame.nbytes - HEADER_SIZE - key_len - data_len - mac_len
    if meta_len < 0:
        raise ProtocolError(f"packed frame of {frame.nbytes} bytes is too short for its header")
    sizes = [HEADER_SIZE, key_len, meta_len, data_len, mac_len]
    views: list[memoryview] = []
    start = 0
    for n in sizes[: 5 if mac_len else 4]:
        views.append(frame[start : start + n])
        start += n
    return views


def peek_header(frames: Sequence[Any]) -> Header | None:
    """The op, flags and ids of a message's header, unchecked beyond its format
    (no signature check): enough to answer a hello that fails authentication."""
    try:
        head = memoryview(frames[0]).cast("B")
        if head.nbytes < HEADER_SIZE:
            return None
        fields = _HEADER.unpack(head[:HEADER_SIZE])
        if fields[0] != MAGIC or fields[1] != VERSION:
            return None
        return Header(
            op=Op(fields[2]),
            flags=fields[3],
            worker_id=fields[9],
            request_id=fields[11],
            session=fields[12],
        )
    except (ValueError, TypeError, IndexError, struct.error):
        return None


def refusal_request_id(frames: Sequence[Any]) -> int | None:
    """The request id of a server's unsigned ``REFUSED`` reply to a hello, else ``None``.

    Read without a signature check: the server that refuses shares no key with
    this client. A client trusts it only as an answer to its own pending hello.
    """
    try:
        msg = _decode(frames, None, 1024)
    except ProtocolError:
        return None
    h = msg.header
    if h.is_reply and h.op == Op.HELLO and h.status == Status.REFUSED:
        return h.request_id
    return None


def reply(
    request: Header,
    *,
    incarnation: int,
    status: Status = Status.OK,
    aux: int = 0,
) -> Header:
    """The header of the reply to ``request`` (same op, ids and key)."""
    return Header(
        op=request.op,
        request_id=request.request_id,
        worker_id=request.worker_id,
        session=request.session,
        seq=request.seq,
        incarnation=incarnation,
        aux=aux,
        priority=request.priority,
        flags=FLAG_REPLY,
        status=status,
    )
