"""The commonest messages, packed from their fields and read back in one step each.

A small request (a push or pull of a few kilobytes at most: one packed frame)
and a reply that carries nothing but its header (the acknowledgement of a
push, an init, a flush) are most of a training job's messages. :mod:`.framing`
takes every message through a :class:`~.message.Header` and a
:class:`~.message.Message`, checking one field at a time; for these two
shapes that bookkeeping cost more than ZeroMQ's round trip. Here they are
packed straight from their fields (:func:`pack`: the bytes
:func:`~.framing.encode` makes, signature included) and a reply is read
straight into its fields (:func:`read_ack`: the checks
:func:`~.framing.decode` makes, in a few comparisons). Any other message
reads as ``None``: the caller decodes it the general way, which accepts it or
says what is wrong with it. ``tests/ps/wire/test_ps_small.py`` holds both ways
against :mod:`.framing`.
"""

from __future__ import annotations

import hmac
import math
import struct
from typing import Any

import torch

from gradhub.ps.wire.protocol.framing import _HEADER, _ITEMSIZE, _OPS, _STATUSES, HEADER_SIZE, _mac
from gradhub.ps.wire.protocol.message import (
    CODECS,
    DTYPES,
    FLAG_MAC,
    FLAG_PACKED,
    FLAG_REPLY,
    MAC_SIZE,
    MAGIC,
    MAX_KEY_BYTES,
    MAX_META_BYTES,
    MAX_NDIM,
    NUMPY_DTYPES,
    VERSION,
    Header,
    Message,
    tensor_frame,
)

__all__ = ["Wire", "pack", "pack_request", "read_ack", "read_request", "wire_of"]

_ZEROS = (0,) * MAX_NDIM
_OP_OF, _STATUS_OF = _OPS, _STATUSES  # codes -> Op, Status
_DTYPE_CODES = {d: c for c, d in DTYPES.items()}
_NO_SHAPE: tuple[int, ...] = ()
_NUMPY_CODES = {
    torch.empty(0, dtype=d).numpy().dtype.char: _DTYPE_CODES[d]
    for d in NUMPY_DTYPES
    if d in _DTYPE_CODES
}
"""numpy's type character of each dtype the wire and numpy both have -> its wire code."""
_ACK_VIEW = struct.Struct(f"<3sBHH4sH8xQ16xQQ{8 + 8 * MAX_NDIM}s")
"""The header as an acknowledgement is read (see ``_HEADER``): magic and version,
op, flags, status, (dtype, codec, ndim, padding), key length, (worker id,
priority), request id, (session, sequence number), incarnation, aux, and the
payload length with the dimensions: the fields in brackets are read together
or not at all."""
assert _ACK_VIEW.size == HEADER_SIZE
_START = MAGIC + bytes([VERSION])
_NO_TENSOR = bytes(4)  # no dtype, codec none, no dimensions (and the padding byte zero)
_NO_PAYLOAD = bytes(8 + 8 * MAX_NDIM)  # payload length and dimensions zero
_ACK = (FLAG_REPLY | FLAG_PACKED, FLAG_REPLY | FLAG_PACKED | FLAG_MAC)  # unsigned, signed
_REQUEST = (FLAG_PACKED, FLAG_PACKED | FLAG_MAC)
_REQUEST_VIEW = struct.Struct("<3sBHHBBBxHIiQQQQQQ")
"""The header up to its dimensions (``_HEADER``, magic and version read together)."""
_DIMS = [struct.Struct(f"<{n * 'Q'}{8 * (MAX_NDIM - n)}s") for n in range(MAX_NDIM + 1)]
"""The dimensions of a header of ``ndim`` n: n sizes, then the bytes that must be zero."""
_NO_DIMS = [bytes(8 * (MAX_NDIM - n)) for n in range(MAX_NDIM + 1)]
assert _REQUEST_VIEW.size + _DIMS[0].size == HEADER_SIZE


def pack(
    op: int,
    flags: int,
    status: int,
    key: bytes,
    worker_id: int,
    priority: int,
    request_id: int,
    session: int,
    seq: int,
    incarnation: int,
    aux: int,
    secret: bytes | None,
    data: Any = b"",
    dcode: int = 0,
    shape: tuple[int, ...] = (),
    meta: bytes = b"",
) -> bytes:
    """One packed frame: what ``encode(..., pack=True)`` makes of a header with these
    fields (codec ``none``), ``key`` (UTF-8, at most ``MAX_KEY_BYTES``), ``meta``
    and ``data`` (a flat byte buffer of at most ``PACK_MAX`` bytes: a tensor's
    :func:`~.message.tensor_frame`, of wire dtype ``dcode`` and ``shape``)."""
    flags = (flags | FLAG_PACKED | FLAG_MAC) if secret else (flags | FLAG_PACKED)
    head = _HEADER.pack(
        MAGIC,
        VERSION,
        op,
        flags,
        status,
        dcode,
        0,
        len(shape),
        len(key),
        worker_id,
        priority,
        request_id,
        session,
        seq,
        incarnation,
        aux,
        len(data),
        *shape,
        *_ZEROS[len(shape) :],
    )
    if secret:
        return b"".join((head, key, meta, data, _mac(secret, (head, key, meta, data))))
    return b"".join((head, key, meta, data))


def pack_request(
    op: int,
    key: str,
    payload: torch.Tensor | None,
    meta: bytes,
    priority: int,
    worker_id: int,
    request_id: int,
    session: int,
    seq: int,
    incarnation: int,
    aux: int,
    secret: bytes | None,
    wire: Wire | None = None,
) -> bytes | None:
    """:func:`pack` of a request whose ``payload`` (CPU, contiguous; at most
    ``PACK_MAX`` bytes) is sent as it is (codec ``none``), or ``None`` where
    :func:`~.framing.encode`'s checks must speak (a key or shape past the limits,
    a dtype the wire lacks). ``wire``: the payload's :func:`wire_of`, if known."""
    key_bytes = key.encode("utf-8")
    if len(key_bytes) > MAX_KEY_BYTES:
        return None
    data: Any = b""
    dcode, shape = 0, _NO_SHAPE
    if wire is None and payload is not None:
        known = wire_of(payload)
        wire = None if known is None else known[0]
    if wire is not None:
        dcode, shape, data = wire
    elif payload is not None:  # empty, bfloat16, autograd, a negative view: as encode does
        dcode = _DTYPE_CODES.get(payload.dtype, 0)
        shape = tuple(payload.shape)
        if not dcode or len(shape) > MAX_NDIM:
            return None
        data = tensor_frame(payload)
    return pack(
        op, 0, 0, key_bytes, worker_id, priority, request_id, session, seq, incarnation, aux,
        secret, data, dcode, shape, meta,
    )  # fmt: skip


Wire = tuple[int, tuple[int, ...], memoryview]
"""A payload as :func:`pack_request` sends it: wire dtype code, shape, its bytes."""


def wire_of(t: torch.Tensor) -> tuple[Wire, Any] | None:
    """``(wire form, numpy view)`` of a plain tensor whose bytes can be sent as they
    lie (on the CPU, contiguous, not empty, of a dtype numpy and the wire both
    have, no autograd, no negative or conjugate view): one call into torch for
    all of these. ``None`` otherwise (then :func:`pack_request` decides)."""
    if type(t) is not torch.Tensor or t.requires_grad:
        return None
    try:
        array = t.numpy()  # refuses other devices, and negative and conjugate views
    except (TypeError, RuntimeError):
        return None
    shape = array.shape
    dcode = _NUMPY_CODES.get(array.dtype.char, 0)
    if not dcode or not array.size or len(shape) > MAX_NDIM or not array.flags.c_contiguous:
        return None
    return (dcode, shape, memoryview(array).cast("B")), array  # type: ignore[arg-type]


def read_ack(frame: bytes, secret: bytes | None) -> tuple[int, int, int, int, int] | None:
    """``(op, status, request_id, incarnation, aux)`` of a packed reply that carries
    neither meta nor payload, checked as :func:`~.framing.decode` checks it
    (signature included); ``None`` for any other message or any fault."""
    size = len(frame)
    if size < HEADER_SIZE:
        return None
    start, op, flags, status, nothing, key_len, rid, incarnation, aux, empty = (
        _ACK_VIEW.unpack_from(frame)
    )
    key_end = HEADER_SIZE + key_len
    if (
        start != _START
        or flags != _ACK[1 if secret else 0]
        or nothing != _NO_TENSOR
        or empty != _NO_PAYLOAD
        or key_len > MAX_KEY_BYTES
        or size != key_end + (MAC_SIZE if secret else 0)
        or op not in _OP_OF
        or status not in _STATUS_OF
    ):
        return None
    try:
        frame[HEADER_SIZE:key_end].decode("utf-8")
    except UnicodeDecodeError:
        return None
    if secret and not hmac.compare_digest(
        _mac(secret, (memoryview(frame)[:key_end],)), frame[key_end:]
    ):
        return None
    return op, status, rid, incarnation, aux


def read_request(frame: Any, secret: bytes | None, max_payload: int) -> Message | None:
    """The :class:`~.message.Message` of a packed request that holds its payload
    itself (no arena), checked as :func:`~.framing.decode` checks it; ``None``
    for any other message or any fault (which ``decode`` then names)."""
    view = memoryview(frame).cast("B")
    size = view.nbytes
    if size < HEADER_SIZE:
        return None
    (
        start, op, flags, status, dcode, ccode, ndim, key_len,
        worker, priority, rid, session, seq, inc, aux, payload_len,
    ) = _REQUEST_VIEW.unpack_from(view)  # fmt: skip
    key_end = HEADER_SIZE + key_len
    data_start = size - (MAC_SIZE if secret else 0) - payload_len
    if (
        start != _START
        or flags != _REQUEST[1 if secret else 0]
        or key_len > MAX_KEY_BYTES
        or payload_len > max_payload
        or not 0 <= data_start - key_end <= MAX_META_BYTES
        or ndim > MAX_NDIM
        or ccode >= len(CODECS)
    ):
        return None
    dims = _DIMS[ndim].unpack_from(view, _REQUEST_VIEW.size)
    op_, status_ = _OP_OF.get(op), _STATUS_OF.get(status)
    if dims[-1] != _NO_DIMS[ndim] or op_ is None or status_ is None:
        return None
    shape = dims[:-1]
    dtype = None
    if dcode:
        dtype = DTYPES.get(dcode)
        if dtype is None or math.prod(shape) * _ITEMSIZE[dcode] != payload_len:
            return None
    elif ndim:
        return None
    try:
        key = str(view[HEADER_SIZE:key_end], "utf-8")
    except UnicodeDecodeError:
        return None
    data_end = data_start + payload_len
    if secret and not hmac.compare_digest(_mac(secret, (view[:data_end],)), view[data_end:]):
        return None
    header = Header(
        op_, rid, worker, session, seq, inc, aux, priority, flags, status_, dtype, CODECS[ccode],
        shape, payload_len,
    )  # fmt: skip
    return Message(header, key, view[data_start:data_end], bytes(view[key_end:data_start]))
