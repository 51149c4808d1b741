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
===================  =======================================================

The ``compress=`` vocabulary (one registry, one check): every ``compress=``
of gradhub names either a *wire codec* (above: what travels; the ``sharded``
and ``ps-*`` strategies, :class:`~gradhub.RemoteParameterServer`,
:class:`~gradhub.AllReduceParameter` and the collectives take these) or a
*bucket reducer* (how the ``allreduce`` strategy sums a gradient bucket:
``"none"``, ``"fp16"``, ``"bf16"``, ``"powersgd"``, and the names
:func:`gradhub.train.reducers.register` adds). :func:`check` is the one
validation every entry point calls, so an unknown name is refused with the
same message everywhere, listing the names that entry point takes.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch

FP16_MAX = 65504.0


class Codec(abc.ABC):
    """Contract: ``decode(encode(x))`` is an fp32 tensor of ``x``'s shape whose
    elements differ from ``x`` by at most ``relative_error * |x|`` (for values in
    the codec's normal range). ``encode`` never modifies its input."""

    name: str
    wire_dtype: torch.dtype
    relative_error: float

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


_CODECS: dict[str, type[Codec]] = {c.name: c for c in (NoCompression, FP16, BF16, BF16Truncate)}
"""The wire codecs. Their order gives each codec its code in the parameter-server
wire header: add new codecs at the end."""

WIRE = "wire codec"
"""Kind of a ``compress=`` name: a :class:`Codec` (what travels)."""
BUCKET = "bucket reducer"
"""Kind of a ``compress=`` name: a bucket reducer of the ``allreduce`` strategy."""

ENTRY_POINTS: dict[str, str] = {
    "allreduce": BUCKET,
    "sharded": WIRE,
    "ps-async/ps-sync/ps-ssp": WIRE,
    "RemoteParameterServer": WIRE,
    "AllReduceParameter": WIRE,
    "a wire codec": WIRE,
}
"""What each ``compress=`` takes (the ``for_`` of :func:`check`)."""

_REDUCERS: dict[str, Callable[..., Any]] = {}
"""Bucket reducer factories by name. Filled when :mod:`gradhub.train.reducers` is
imported (its built-ins) and by :func:`gradhub.train.reducers.register`: the one
piece of module-level state of the vocabulary, as a plug-in registry is."""


def available(kind: str = WIRE) -> list[str]:
    """The names of ``kind`` (:data:`WIRE`: in wire-code order; :data:`BUCKET`: sorted)."""
    if kind == WIRE:
        return list(_CODECS)
    if kind == BUCKET:
        return sorted(_REDUCERS)
    raise ValueError(f"unknown kind {kind!r}; choose {WIRE!r} or {BUCKET!r}")


def check(name: object, *, for_: str) -> str:
    """The canonical name if ``name`` is a ``compress=`` value that ``for_`` (a key
    of :data:`ENTRY_POINTS`: a strategy or a class) takes, else ``ValueError``
    naming the entry point and listing what it takes. Wire codec names are
    case-insensitive; a :class:`Codec` instance passes where a wire codec does."""
    kind = ENTRY_POINTS[for_]
    if kind == WIRE:
        if isinstance(name, Codec):
            return name.name
        if isinstance(name, str) and name.lower() in _CODECS:
            return name.lower()
    elif isinstance(name, str) and name in _REDUCERS:
        return name
    extra = "; gradhub.train.reducers.register adds one" if kind == BUCKET else ""
    raise ValueError(
        f"unknown compress={name!r} for {for_}\n"
        f"- help: choose one of {', '.join(available(kind))} ({kind}s{extra})"
    )


def get(name: str | Codec, *, for_: str = "a wire codec") -> Codec:
    """The codec called ``name`` (a codec instance is returned as is); ``for_``
    names the caller in the error for an unknown name (:func:`check`)."""
    if isinstance(name, Codec):
        return name
    return _CODECS[check(name, for_=for_)]()


def register_reducer(name: str, factory: Callable[..., Any]) -> None:
    """Add a bucket reducer name (:func:`gradhub.train.reducers.register` calls this)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a bucket reducer name is a non-empty str, got {name!r}")
    if name in _REDUCERS:
        raise ValueError(f"a bucket reducer called {name!r} is already registered")
    _REDUCERS[name] = factory


def reducer_factory(name: str) -> Callable[..., Any]:
    """The factory of the bucket reducer ``name`` (``ValueError`` listing them if unknown)."""
    return _REDUCERS[check(name, for_="allreduce")]


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
            raise ValueError(
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
