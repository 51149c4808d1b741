"""How the shared-memory transport adds the ranks' values.

Every rank's values lie in memory every rank maps, so a sum is an addition
of tensors, in :func:`~.schedule.reduction_order` (the owner's own values
last), the ring's bits (:func:`~.schedule.add_in_order`).

16-bit values (bf16, fp16; the torch.distributed backend's all-reduce, whose
numerics :mod:`gradhub.backend.operations` states): every value widened to
fp32 (exact), added in fp32 in that order, the sum rounded to the dtype once
(to nearest even; beyond its range: inf). :func:`add_widened` forms exactly
those bits without an fp32 copy of the vectors: bf16 values by
:func:`gradhub._shm.native.sum_bf16` (a C loop, about twice ATen's speed)
where it is available; otherwise two values are one ATen addition of the
16-bit tensors (which widens both, adds in fp32 and rounds the result once),
and more are added in fp32 chunks of :data:`CHUNK` elements that stay in
the cache.

:func:`add_everywhere`: every rank adds every slice itself (the transport's
one-synchronisation all-reduce of small vectors), each slice in its owner's
order, so every rank forms the bits the owner would.
"""

from __future__ import annotations

import torch

from gradhub import codecs
from gradhub._shm import native
from gradhub.partition import partition_ranges
from gradhub.transports.group import CollectiveGroup
from gradhub.transports.schedule import add_in_order, reduction_order

_PLAIN = codecs.NoCompression()
CHUNK = 1 << 16
"""Elements per fp32 chunk of a 16-bit sum of more than two vectors (256 KiB)."""


def add_widened(
    parts: list[torch.Tensor], own: torch.Tensor, out: torch.Tensor, scratch: torch.Tensor
) -> None:
    """``out`` = ``((parts[0] + parts[1]) + ...) + own`` in fp32, rounded to
    ``out``'s dtype once.

    ``parts`` and ``own``: 16-bit tensors of one dtype and length; ``out`` of
    that dtype, may be ``own``; ``scratch``: fp32, at least ``min(len, CHUNK)``
    elements (unused for one part).
    """
    if native.sum_bf16([*parts, own], out):
        return
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


def add_values(
    parts: list[torch.Tensor],
    own: torch.Tensor,
    codec: codecs.Codec,
    out: torch.Tensor,
    *,
    hop: bool,
    group: CollectiveGroup,
) -> None:
    """:func:`~.schedule.add_in_order` (fp32 or wire values) with a scratch
    buffer of ``group``'s; plain 16-bit values (``"none"``) by :func:`add_widened`."""
    n = own.numel()
    if own.dtype == torch.float32:
        scratch = group.scratch("shm_acc", n, torch.float32)
        add_in_order(parts, own, codec, out, hop=hop, scratch=scratch)
    else:
        add_widened(parts, own, out, group.scratch("shm_acc", min(n, CHUNK), torch.float32))


def add_everywhere(regions: list[torch.Tensor], out: torch.Tensor, group: CollectiveGroup) -> None:
    """``out`` = the sum of ``regions`` (one vector per local rank, plain values),
    each rank's slice (:func:`~gradhub.partition.partition_ranges`) in its
    owner's :func:`~.schedule.reduction_order`."""
    size = len(regions)
    if size == 2:  # a + b = b + a (also widened and rounded once): one addition
        if not native.sum_bf16(regions, out):
            torch.add(regions[0], regions[1], out=out)
        return
    for c, (s, n) in enumerate(partition_ranges(out.numel(), size)):
        *parts, own = [regions[j][s : s + n] for j in reduction_order(c, size)]
        if n:
            add_values(parts, own, _PLAIN, out[s : s + n], hop=False, group=group)
