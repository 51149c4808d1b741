"""What a parameter-server message is: its ops, statuses, header fields, dtype
and codec codes, and the :class:`Message` a decoded one becomes
(:mod:`gradhub.ps.wire.protocol` describes the wire format; :mod:`.framing` turns a
message into frames and back)."""

from __future__ import annotations

import enum
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gradhub import codecs
from gradhub.errors import ProtocolError, WrongTypeError

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

PACK_MAX = 16 << 10
"""Largest payload frame a packed message holds (``encode(..., pack=True)``)."""

ARENA_LOCATOR = struct.Struct("<IQQ")
"""The payload frame of an arena message: segment id, byte offset, length."""

ArenaResolver = Callable[[int, bytes], memoryview]
"""``(session, locator) -> the bytes it names``; raises ``ProtocolError`` if it names none."""


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
    STATE = 10  # read a key's optimizer state (gradhub.ps.wire.optim_state)
    SET_STATE = 11  # replace a key's optimizer state
    MEMBERS = 12  # a surviving job's membership (meta: members, generation)


MUTATING = (Op.PUSH, Op.INIT, Op.SET_STATE)
"""Requests with a sequence number, applied exactly once and retained until durable."""


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


DTYPES: dict[int, torch.dtype] = {
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
_DTYPE_CODES = {d: c for c, d in DTYPES.items()}

CODECS = tuple(codecs.available())
"""Codec names by wire code: the one registry's order (:func:`gradhub.codecs.available`)."""


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of ``dtype`` (:class:`~gradhub.errors.WrongTypeError` for dtypes the
    wire cannot carry)."""
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise WrongTypeError(
            f"dtype {dtype} cannot be sent to a parameter server; use one of "
            f"{', '.join(str(d) for d in DTYPES.values())}"
        ) from None


def dtype_of(code: int) -> torch.dtype:
    """The dtype of a wire code (``ProtocolError`` for an unknown one)."""
    try:
        return DTYPES[code]
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
            flat = torch.frombuffer(bytearray(self.payload), dtype=h.dtype)
        else:
            flat = torch.frombuffer(self.payload, dtype=h.dtype)
        return flat if len(h.shape) == 1 else flat.view(h.shape)  # 1-D: already its shape

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


NUMPY_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)  # dtypes whose tensors ``numpy()`` views directly (not bfloat16, float8, complex)


def tensor_frame(tensor: torch.Tensor) -> memoryview | bytes:
    """A buffer over ``tensor``'s memory (contiguous CPU), for a zero-copy send.

    The buffer keeps the tensor alive; the caller must not modify the tensor
    until the send is done.
    """
    t = tensor.detach()
    if not t.is_cpu:
        t = t.cpu()
    if t.numel() == 0:
        return b""
    if t.dtype in NUMPY_DTYPES and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        # One call instead of three torch views: the bytes of a dtype numpy knows.
        return memoryview(t.numpy()).cast("B")  # type: ignore[arg-type]
    t = t.contiguous().reshape(-1).view(torch.uint8)
    return memoryview(t.numpy())  # type: ignore[arg-type]


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
