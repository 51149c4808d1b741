"""Sums of 16-bit floats (bf16, fp16) in fp32, rounded once.

The numerics the torch.distributed backend states for 16-bit sums
(:mod:`gradhub.backend.operations`): every value widened to fp32 (exact), the
values added in fp32 in :func:`~.schedule.reduction_order` (the owner's own
last), the sum rounded to the dtype once (to nearest even; beyond its range:
inf). :func:`add_widened` forms exactly those bits without an fp32 copy of
the vectors: two values are one ATen addition of the 16-bit tensors (which
widens both, adds in fp32 and rounds the result once); more are added in
fp32 chunks of :data:`CHUNK` elements that stay in the cache.
"""

from __future__ import annotations

import torch

CHUNK = 1 << 16
"""Elements per fp32 chunk of a sum of more than two vectors (256 KiB)."""


def add_widened(
    parts: list[torch.Tensor], own: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor
) -> None:
    """``out`` = ``((parts[0] + parts[1]) + ...) + own`` in fp32, rounded to
    ``out``'s dtype once.

    ``parts`` and ``own``: 16-bit tensors of one dtype and length; ``out`` of
    that dtype, may be ``own``; ``scratch``: fp32, at least ``min(len, CHUNK)``
    elements (unused for one part).
    """
    if len(parts) == 1:  # fp32(a) + fp32(b), rounded once: ATen's 16-bit addition
        torch.add(parts[0], own, out=out)
        return
    n = own.numel()
    for start in range(0, n, CHUNK):
        end = min(start + CHUNK, n)
        acc = scratch[: end - start]
        acc.copy_(parts[0][start:end])
        for part in parts[1:]:
            acc.add_(part[start:end])  # fp32 += widened 16-bit values
        torch.add(acc, own[start:end], out=out[start:end])  # in fp32, then rounded
