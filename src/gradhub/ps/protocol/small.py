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
says what is wrong with it. ``tests/ps/test_ps_small.py`` holds both ways
against :mod:`.framing`.
"""

from __future__ import annotations

import hmac
import math
import struct
from typing import Any

from gradhub.ps.protocol.framing import _HEADER, _ITEMSIZE, _OPS, _STATUSES, HEADER_SIZE, _mac
from gradhub.ps.protocol.message import (
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
    VERSION,
    Header,
    Message,
)

__all__ = ["pack", "read_ack", "read_request"]

_ZEROS = (0,) * MAX_NDIM
_OP_OF, _STATUS_OF = _OPS, _STATUSES  # codes -> Op, Status
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
    f = _HEADER.unpack_from(view)
    key_len, payload_len, ndim, dcode = f[8], f[16], f[7], f[5]
    mac_len = MAC_SIZE if secret else 0
    key_end = HEADER_SIZE + key_len
    data_start = size - mac_len - payload_len
    if (
        f[0] != MAGIC
        or f[1] != VERSION
        or f[3] != _REQUEST[1 if secret else 0]
        or key_len > MAX_KEY_BYTES
        or payload_len > max_payload
        or not 0 <= data_start - key_end <= MAX_META_BYTES
        or ndim > MAX_NDIM
        or f[6] >= len(CODECS)
        or f[17 + ndim :] != _ZEROS[ndim:]
    ):
        return None
    op, status = _OP_OF.get(f[2]), _STATUS_OF.get(f[4])
    if op is None or status is None:
        return None
    shape = f[17 : 17 + ndim]
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
    if secret and not hmac.compare_digest(
        _mac(secret, (view[: size - MAC_SIZE],)), view[size - MAC_SIZE :]
    ):
        return None
    header = Header(
        op,
        f[11],
        f[9],
        f[12],
        f[13],
        f[14],
        f[15],
        f[10],
        f[3],
        status,
        dtype,
        CODECS[f[6]],
        shape,
        payload_len,
    )
    return Message(header, key, view[data_start : size - mac_len], bytes(view[key_end:data_start]))
