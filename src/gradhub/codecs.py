"""Wire compression for gradients and weights.

A :class:`Codec` turns an fp32 tensor into a *wire* tensor (what is sent) and
back. Arithmetic is always done in fp32 after :meth:`Codec.decode`; only the
wire is compressed. Codecs are stateless; :class:`ErrorFeedback` wraps one and
carries the rounding error of each call into the next, so the running sum of
decoded values stays within one quantum of the true running sum.

Codecs shipped (``get(name)``):

===================  =======================================================
``"none"``           fp32 as is; exact.
``"fp16"``           IEEE half, round to nearest even; values beyond the
                     half range saturate at +-65504 (``FP16(saturate=False)``:
                     they become inf, as a loss scaler needs to see them).
                     Relative error <= 2**-11 for normal values; callers that
                     sum on the wire scale (divide by the number of addends)
                     before encoding.
``"bf16"``           bfloat16, round to nearest even; relative error <= 2**-8.
``"bf16-truncate"``  the high 16 bits of the fp32 pattern (BigDL's
                     FP16CompressedTensor): 1.111111 -> 1.109375, integers up
                     to 256 exact; relative error < 2**-7, always towards 0.
``"fp4"``            4-bit floats (E2M1) in blocks of 32 values with one fp32
                     scale each (MXFP4's layout; its scale is a power of 2):
                     0.625 bytes per value plus a small header; a *tensor
                     codec* (:class:`FP4`), taken by ``diloco`` only.
===================  =======================================================

The ``compress=`` vocabulary (one registry, one check): every ``compress=``
of gradhub names either a *wire codec* (above: what travels; the ``sharded``
and ``ps-*`` strategies, :class:`~gradhub.RemoteParameterServer`,
:class:`~gradhub.AllReduceParameter` and the collectives take the elementwise
ones, whose wire holds one element per value, so the transports may cut it
anywhere; ``diloco`` also takes the *tensor codecs*, ``"fp4"``, whose wire
is one whole tensor's blocks, scales and shape, sent as a unit) or a
*bucket reducer* (how the ``allreduce`` strategy sums a gradient bucket:
``"none"``, ``"fp16"``, ``"bf16"``, ``"powersgd"``, and the names
:func:`gradhub.train.reducers.register` adds; their registry is
:mod:`gradhub.train.reducers.registry`, which hands its names to
:func:`check`). :func:`check` is the one validation every entry point calls,
so an unknown name is refused with the same message everywhere, listing the
names that entry point takes.
"""

from __future__ import annotations

import abc
from collections.abc import Collection

import torch

from gradhub.errors import InvalidOptionError

FP16_MAX = 65504.0


class Codec(abc.ABC):
    """Contract: ``decode(encode(x))`` is an fp32 tensor of ``x``'s shape whose
    elements differ from ``x`` by at most ``relative_error * |x|`` (for values in
    the codec's normal range; a tensor codec, :attr:`elementwise` ``False``,
    states its own bound: :class:`FP4`'s depends on each block's largest value).
    ``encode`` never modifies its input."""

    name: str
    wire_dtype: torch.dtype
    relative_error: float
    elementwise: bool = True
    """One wire element per value, decoded on its own (a slice of the wire is the
    wire of that slice). ``False``: a tensor codec, whose wire is decoded whole."""

    @property
    def bytes_per_element(self) -> int:
        """Bytes per element on the wire."""
        return torch.empty((), dtype=self.wire_dtype).element_size()

    @property
    def bytes_ratio(self) -> float:
        """Wire bytes per fp32 byte."""
        return self.bytes_per_element / 4

    @abc.abstractmethod
    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        """The wire form of an fp32 (or castable) tensor."""

    def decode(self, wire: torch.Tensor) -> torch.Tensor:
        """The fp32 values of a wire tensor (a new tensor)."""
        return wire.to(torch.float32, copy=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoCompression(Codec):
    name = "none"
    wire_dtype = torch.float32
    relative_error = 0.0

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(torch.float32, copy=True)


class FP16(Codec):
    """IEEE half. ``saturate`` (the default): a value beyond the half range is
    sent as +-65504; ``saturate=False``: as inf (IEEE rounding), so an
    overflow of loss-scaled gradients reaches the scaler's inf check."""

    name = "fp16"
    wire_dtype = torch.float16
    relative_error = 2.0**-11

    def __init__(self, *, saturate: bool = True) -> None:
        self.saturate = saturate

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        value = tensor.to(torch.float32)
        if self.saturate:
            value = value.clamp(-FP16_MAX, FP16_MAX)
        return value.to(torch.float16)

    def __repr__(self) -> str:
        return f"FP16(saturate={self.saturate})"


class BF16(Codec):
    name = "bf16"
    wire_dtype = torch.bfloat16
    relative_error = 2.0**-8

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(torch.float32).to(torch.bfloat16)


class BF16Truncate(Codec):
    name = "bf16-truncate"
    wire_dtype = torch.bfloat16
    relative_error = 2.0**-7

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        bits = tensor.to(torch.float32).contiguous().view(torch.int32)
        # Arithmetic shift keeps the sign; the int16 cast keeps the low 16 bits,
        # which are now the high half of the fp32 pattern.
        return (bits >> 16).to(torch.int16).view(torch.bfloat16)


FP4_BLOCK = 32
"""Values per scale of :class:`FP4` (the OCP microscaling formats' block)."""
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of E2M1 (1 sign, 2 exponent, 1 mantissa bit), by code 0..7."""
_FP4_MAX = 6.0
# Round to nearest, ties to the even code: the midpoints between neighbours, each
# lowered by one ulp where the tie goes up (to an even code above it).
_FP4_EDGES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


class FP4(Codec):
    """4-bit floats, E2M1, in blocks of :data:`FP4_BLOCK` values with one fp32 scale.

    Encode: the tensor is read flat and cut into blocks of 32 (the last one
    padded with zeros); a block's scale is its largest magnitude divided by 6
    (the largest E2M1 value), so that value travels as 6 times the scale; each value
    ``x / scale`` is rounded to the nearest E2M1 magnitude (ties to the even
    code), its sign in the fourth bit, two codes per byte (the first in the
    low nibble). The wire is one uint8 tensor: the shape (int64 count of
    dimensions, then the dimensions), the fp32 scales, the packed codes:
    ``8 * (1 + ndim) + 20 * ceil(n / 32)`` bytes, about 0.625 bytes per value
    (fp32 takes 4). Decode: ``code value * scale`` in fp32, in ``x``'s shape.

    Error: every value is off by at most ``max(relative_error * |x|, m / 24)``,
    ``m`` its block's largest magnitude: a value of at least ``m / 6`` (E2M1's
    normal range after scaling) by at most ``relative_error`` (1/4; 1/5 is the
    worst case, 1.25 rounded to 1) times itself, a smaller one by at most half
    of E2M1's smallest step (0.5) times the scale; a block of zeros is exact.
    This holds where the scale is a normal fp32
    (a largest magnitude of at least ``6 * 2**-126``); a block of smaller
    values decodes within twice its largest magnitude. ``-0.0`` decodes as
    ``0.0``. Non-finite values: a block holding an infinity or NaN decodes to
    NaN in all its places (E2M1 has neither; the sum it joins is non-finite,
    as an fp32 sum with it would be, and a non-finite check sees it).

    A tensor codec (``elementwise`` is ``False``): the wire must travel whole,
    so only entry points that send each tensor as a unit take it
    (:func:`check`; ``diloco``'s ``compress=``).
    """

    name = "fp4"
    wire_dtype = torch.uint8
    relative_error = 0.25
    elementwise = False

    @property
    def bytes_ratio(self) -> float:
        """Wire bytes per fp32 byte, header left out: 20 bytes per 32 values."""
        return (FP4_BLOCK // 2 + 4) / (4 * FP4_BLOCK)

    def wire_bytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        """The length of the wire of a tensor of ``shape``, in bytes."""
        numel = 1
        for d in shape:
            numel *= d
        blocks = -(-numel // FP4_BLOCK)
        return 8 * (1 + len(shape)) + blocks * (4 + FP4_BLOCK // 2)

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        shape = tuple(tensor.shape)
        flat = tensor.detach().to(torch.float32).reshape(-1)
        blocks = -(-flat.numel() // FP4_BLOCK)
        padded = flat.new_zeros(blocks * FP4_BLOCK)
        padded[: flat.numel()] = flat
        values = padded.view(blocks, FP4_BLOCK)
        largest = values.abs().amax(dim=1)
        scale = torch.where(
            torch.isfinite(largest), largest / _FP4_MAX, torch.full_like(largest, float("nan"))
        )
        divisor = torch.where(scale == 0, torch.ones_like(scale), scale)
        magnitude = (values.abs() / divisor[:, None]).nan_to_num_(0.0, 0.0, 0.0)
        codes = torch.bucketize(magnitude, _edges(values.device)).to(torch.uint8)
        codes |= (values < 0).to(torch.uint8) << 3
        pairs = codes.view(-1, 2)
        packed = pairs[:, 0] | (pairs[:, 1] << 4)
        head = torch.tensor([len(shape), *shape], dtype=torch.int64, device=values.device)
        return torch.cat([head.view(torch.uint8), scale.view(torch.uint8), packed])

    def decode(self, wire: torch.Tensor) -> torch.Tensor:
        data = wire.reshape(-1)  # views of its parts are copies: any offset is fine
        ndim = int(data[:8].clone().view(torch.int64)[0])
        shape = [int(d) for d in data[8 : 8 * (1 + ndim)].clone().view(torch.int64)]
        numel = 1
        for d in shape:
            numel *= d
        blocks = -(-numel // FP4_BLOCK)
        start = 8 * (1 + ndim)
        scale = data[start : start + 4 * blocks].clone().view(torch.float32)
        packed = data[start + 4 * blocks : start + 4 * blocks + blocks * FP4_BLOCK // 2]
        codes = torch.stack([packed & 15, packed >> 4], dim=1).view(blocks, FP4_BLOCK)
        table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=data.device)
        values = table[(codes & 7).long()]
        values = torch.where(codes >= 8, -values, values) * scale[:, None]
        return values.reshape(-1)[:numel].reshape(shape)


def _edges(device: torch.device) -> torch.Tensor:
    edges = torch.tensor(_FP4_EDGES, dtype=torch.float32, device=device)
    up = torch.tensor([False, True, False, True, False, True, False], device=device)
    return torch.where(up, torch.nextafter(edges, torch.zeros_like(edges)), edges)


_CODECS: dict[str, type[Codec]] = {
    c.name: c for c in (NoCompression, FP16, BF16, BF16Truncate, FP4)
}
"""The wire codecs. Their order gives each codec its code in the parameter-server
wire header: add new codecs at the end."""

WIRE = "wire codec"
"""Kind of a ``compress=`` name: an elementwise :class:`Codec` (what travels)."""
TENSOR = "tensor codec"
"""Kind of a ``compress=`` name: any :class:`Codec`, tensor codecs (``fp4``) too."""
BUCKET = "bucket reducer"
"""Kind of a ``compress=`` name: a bucket reducer of the ``allreduce`` strategy."""

ENTRY_POINTS: dict[str, str] = {
    "allreduce": BUCKET,
    "sharded": WIRE,
    "ps-async/ps-sync/ps-ssp": WIRE,
    "RemoteParameterServer": WIRE,
    "AllReduceParameter": WIRE,
    "a wire codec": WIRE,
    "diloco": TENSOR,
}
"""What each ``compress=`` takes (the ``for_`` of :func:`check`)."""


def available(kind: str = WIRE) -> list[str]:
    """The codec names of ``kind`` (:data:`WIRE` or :data:`TENSOR`), in wire-code
    order. The :data:`BUCKET` names are the reducers' registry's
    (:func:`gradhub.train.reducers.available`)."""
    if kind == WIRE:
        return [name for name, c in _CODECS.items() if c.elementwise]
    if kind == TENSOR:
        return list(_CODECS)
    raise InvalidOptionError(
        f"unknown kind {kind!r}; choose {WIRE!r} or {TENSOR!r} "
        "(the bucket reducers are gradhub.train.reducers.available())"
    )


def check(name: object, *, for_: str, reducers: Collection[str] = ()) -> str:
    """The canonical name if ``name`` is a ``compress=`` value that ``for_`` (a key
    of :data:`ENTRY_POINTS`: a strategy or a class) takes, else ``ValueError``
    naming the entry point and listing what it takes. Wire codec names are
    case-insensitive; a :class:`Codec` instance passes where a wire codec does.
    A tensor codec (``fp4``) where only elementwise ones go is refused saying so.
    ``reducers``: the bucket reducer names, for an entry point that takes them
    (:mod:`gradhub.train.reducers.registry` passes its own, sorted)."""
    kind = ENTRY_POINTS[for_]
    names = list(reducers) if kind == BUCKET else available(kind)
    if kind in (WIRE, TENSOR):
        codec = name if isinstance(name, Codec) else None
        if isinstance(name, str) and name.lower() in _CODECS:
            codec = _CODECS[name.lower()]()
        if codec is not None and (codec.elementwise or kind == TENSOR):
            return codec.name
        if codec is not None:
            raise InvalidOptionError(
                f"compress={codec.name!r} is a tensor codec (blocks of values with a scale "
                f"each, decoded whole); {for_} takes elementwise codecs only (its wire is cut into "
                f"slices)\n- help: choose one of "
                f"{', '.join(names)} ({kind}s); {codec.name} goes with strategy "
                "'diloco' (its pseudo-gradients)"
            )
    elif isinstance(name, str) and name in names:
        return name
    extra = "; gradhub.train.reducers.register adds one" if kind == BUCKET else ""
    raise InvalidOptionError(
        f"unknown compress={name!r} for {for_}\n"
        f"- help: choose one of {', '.join(names)} ({kind}s{extra})"
    )


def get(name: str | Codec, *, for_: str = "a wire codec") -> Codec:
    """The codec called ``name`` (a codec instance is returned as is); ``for_``
    names the caller in the error for an unknown name (:func:`check`)."""
    if isinstance(name, Codec):
        return name
    return _CODECS[check(name, for_=for_)]()


class ErrorFeedback:
    """Carries each call's rounding error into the next (error compensation).

    ``encode(x)`` sends ``codec.encode(x + residual)`` and keeps
    ``residual = (x + residual) - decode(wire)``. Over many calls the sum of what
    was decoded differs from the sum of what was given by the last residual
    only, which is at most one quantum of the codec. One instance per stream
    (per buffer, per key); the residual's shape is fixed by the first call.
    """

    def __init__(self, codec: str | Codec):
        self.codec = get(codec)
        self.residual: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return self.codec.name

    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        value = tensor.to(torch.float32)
        if self.residual is None:
            self.residual = torch.zeros_like(value)
        elif self.residual.shape != value.shape:
            raise InvalidOptionError(
                f"error feedback stream has shape {list(self.residual.shape)}, "
                f"got {list(value.shape)}; use one ErrorFeedback per buffer"
            )
        compensated = value + self.residual
        wire = self.codec.encode(compensated)
        self.residual = compensated - self.codec.decode(wire)
        return wire

    def decode(self, wire: torch.Tensor) -> torch.Tensor:
        return self.codec.decode(wire)

    def reset(self) -> None:
        self.residual = None
