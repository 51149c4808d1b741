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
"""

from __future__ import annotations

import abc

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
"""The one registry of codec names. Its order gives each codec its code in the
parameter-server wire header: add new codecs at the end."""


def available() -> list[str]:
    """Names accepted by :func:`get`."""
    return list(_CODECS)


def get(name: str | Codec) -> Codec:
    """The codec called ``name`` (a codec instance is returned as is)."""
    if isinstance(name, Codec):
        return name
    try:
        return _CODECS[name.lower()]()
    except (KeyError, AttributeError):
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(_CODECS)}") from None


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
