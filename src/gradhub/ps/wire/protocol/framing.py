"""Turning a :class:`~gradhub.ps.wire.protocol.message.Message` into ZeroMQ frames and
back: the header's byte layout, packing small messages into one frame, the
HMAC, and every check :func:`decode` makes (see :mod:`gradhub.ps.wire.protocol`)."""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
from collections.abc import Sequence
from typing import Any

import torch

from gradhub.errors import (
    AuthenticationError,
    InvalidOptionError,
    OversizedError,
    ProtocolError,
    UnknownOpError,
)
from gradhub.ps.wire.protocol.message import (
    ARENA_LOCATOR,
    CODECS,
    DEFAULT_MAX_PAYLOAD,
    DTYPES,
    FLAG_ARENA,
    FLAG_MAC,
    FLAG_PACKED,
    FLAG_REPLY,
    MAC_SIZE,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_META_BYTES,
    MAX_NDIM,
    PACK_MAX,
    VERSION,
    ArenaResolver,
    Header,
    Message,
    Op,
    Status,
    dtype_code,
    tensor_frame,
)

_HEADER = struct.Struct("<2sBBHHBBBxHIiQQQQQQ" + "Q" * MAX_NDIM)
"""The header's byte layout (little-endian; see :mod:`gradhub.ps.wire.protocol`)."""
HEADER_SIZE = _HEADER.size
_KNOWN_FLAGS = FLAG_REPLY | FLAG_MAC | FLAG_ARENA | FLAG_PACKED
_OPS = {int(o): o for o in Op}  # a dict lookup costs a fraction of Op(code)
_STATUSES = {int(s): s for s in Status}
_ITEMSIZE = {c: torch.empty((), dtype=d).element_size() for c, d in DTYPES.items()}
_CODEC_CODES = {name: i for i, name in enumerate(CODECS)}
_ZEROS = (0,) * MAX_NDIM


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
        raise InvalidOptionError(
            f"key {key[:40]!r}... is {len(key_bytes)} bytes; the limit is {MAX_KEY_BYTES}"
        )
    data: Any
    if isinstance(payload, torch.Tensor):
        shape = tuple(payload.shape)
        if len(shape) > MAX_NDIM:
            raise InvalidOptionError(
                f"tensors of more than {MAX_NDIM} dimensions cannot be sent\n- help: init, "
                "push and pull a view of it with fewer dimensions (e.g. t.view(-1))"
            )
        header.dtype = payload.dtype
        header.shape = shape
        data = tensor_frame(payload)
        header.payload_len = len(data) if isinstance(data, bytes) else data.nbytes
    else:
        data = b"" if payload is None else payload
        header.payload_len = len(data) if isinstance(data, bytes) else memoryview(data).nbytes
        header.dtype, header.shape = None, ()
    signed = data
    if arena is not None:
        data = arena
    size = len(data) if isinstance(data, bytes) else memoryview(data).nbytes
    packed = pack and size <= PACK_MAX
    flags = header.flags & ~FLAG_PACKED
    if secret:
        flags |= FLAG_MAC
    if arena is not None:
        flags |= FLAG_ARENA
    if packed:
        flags |= FLAG_PACKED
    header.flags = flags
    shape = header.shape
    head = _HEADER.pack(
        MAGIC,
        VERSION,
        header.op,
        flags,
        header.status,
        0 if header.dtype is None else dtype_code(header.dtype),
        _CODEC_CODES[header.codec],
        len(shape),
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
        *_ZEROS[len(shape) :],
    )
    frames: list[Any] = [head, key_bytes, meta, data]
    if secret:
        frames.append(_mac(secret, frames if arena is None else [*frames, signed]))
    return [b"".join(frames)] if packed else frames


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
        views, fields = _unpack(memoryview(frames[0]).cast("B"))  # the header read once
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
        if dcode not in DTYPES:
            raise UnknownOpError(f"unknown dtype code {dcode}")
        dtype = DTYPES[dcode]
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


def _unpack(frame: memoryview) -> tuple[list[memoryview], tuple[Any, ...]]:
    """The views of a packed frame as separate frames: header, key, meta, payload[, mac]
    (sizes from the header; what does not add up is left for the checks to refuse),
    and the header's fields."""
    if frame.nbytes < HEADER_SIZE:
        raise ProtocolError(f"packed frame of {frame.nbytes} bytes is shorter than a header")
    fields = _HEADER.unpack_from(frame)
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
    return views, fields


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
