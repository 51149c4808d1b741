"""The ring schedule: which chunk each rank sends and receives at each step.

Pure functions, no communication, so the algorithm can be checked (and
simulated) without processes. Chunk ``c`` is the slice that rank ``c`` owns
(:func:`gradhub.partition.partition_range`). With ``P`` ranks, rank ``r``
sends to ``r + 1`` and receives from ``r - 1`` (mod ``P``).

Reduce-scatter runs ``P - 1`` steps. At step ``s`` rank ``r`` sends the partial
sum of chunk ``r - s - 1`` and receives the partial sum of chunk ``r - s - 2``,
to which it adds its own values. So chunk ``c`` starts at rank ``c + 1``, is
added to by ``c + 2, ..., c - 1`` and ends at its owner ``c``, which adds its
own values last: :func:`reduction_order`. Every chunk is therefore summed in
one fixed order, whatever the timing, and the sum exists on one rank only;
the all-gather copies its bits, so every rank holds bit-identical values.

All-gather runs ``P - 1`` steps. At step ``s`` rank ``r`` forwards chunk
``r - s`` and receives chunk ``r - s - 1``; the bytes are forwarded unchanged.
"""

from __future__ import annotations

import torch

from gradhub import codecs
from gradhub.errors import InvalidOptionError
from gradhub.partition import partition_ranges

TAG_SEQ_BITS = 10
TAG_INDEX_BITS = 20


def reduce_scatter_send_chunk(rank: int, step: int, world_size: int) -> int:
    """The chunk whose partial sum ``rank`` sends at ``step`` of the reduce-scatter."""
    return (rank - step - 1) % world_size


def reduce_scatter_recv_chunk(rank: int, step: int, world_size: int) -> int:
    """The chunk whose partial sum ``rank`` receives (and adds to) at ``step``."""
    return (rank - step - 2) % world_size


def all_gather_send_chunk(rank: int, step: int, world_size: int) -> int:
    """The chunk ``rank`` forwards at ``step`` of the all-gather."""
    return (rank - step) % world_size


def all_gather_recv_chunk(rank: int, step: int, world_size: int) -> int:
    """The chunk ``rank`` receives at ``step`` of the all-gather."""
    return (rank - step - 1) % world_size


def reduction_order(chunk: int, world_size: int) -> list[int]:
    """The ranks whose values are added for ``chunk``, first to last.

    The sum is ``((x[o[0]] + x[o[1]]) + x[o[2]]) + ...`` with ``o`` this list;
    the owner (``chunk``) comes last. A single-process reference that sums in
    this order reproduces the ring's fp32 result bit for bit.
    """
    return [(chunk + 1 + i) % world_size for i in range(world_size)]


def add_in_order(
    parts: list[torch.Tensor],
    own: torch.Tensor,
    codec: codecs.Codec,
    out: torch.Tensor,
    *,
    hop: bool,
    scratch: torch.Tensor,
) -> None:
    """``out`` = the other ranks' ``parts`` (in :func:`reduction_order`) plus
    ``own``, last, rounded as the ring rounds (for shared memory, which holds
    every rank's values at once).

    ``parts`` hold fp32 values, or wire values when ``hop`` is false and the
    codec is lossy. ``hop``: the ring's point-to-point path (the partial sum
    rounded to the codec once per hop; ``"fp16"`` divided by the number of
    ranks before, multiplied after); else its collective path (each
    contribution rounded once). ``out`` may be ``own``; ``scratch`` holds
    ``own.numel()`` fp32 elements.
    """
    world_size = len(parts) + 1
    if isinstance(codec, codecs.NoCompression):
        acc = parts[0]
        if world_size > 2:
            acc = torch.add(parts[0], parts[1], out=scratch)
            for part in parts[2:]:
                acc.add_(part)
        torch.add(acc, own, out=out)
    elif hop:
        prescale = codec.wire_dtype == torch.float16
        last = torch.div(own, world_size) if prescale else own
        acc = codec.decode(codec.encode(parts[0]))
        for part in parts[1:]:
            acc = codec.decode(codec.encode(acc.add_(part)))
        torch.add(acc, last, out=out)
        if prescale:
            out.mul_(world_size)
    else:
        last = codec.decode(codec.encode(own))  # before out (maybe own) is written
        out.copy_(codec.decode(parts[0]))
        for part in parts[1:]:
            out.add_(codec.decode(part))
        out.add_(last)


def sub_ranges(start: int, length: int, max_elements: int) -> list[tuple[int, int]]:
    """Split ``[start, start + length)`` into the fewest near-equal pieces of at most
    ``max_elements`` (none when ``length`` is 0).

    Pieces let a rank add (or forward) one piece while the next is on the wire.
    Every rank computes the same pieces from the same chunk, so they need not
    be agreed on at run time.
    """
    if max_elements < 1:
        raise InvalidOptionError(f"max_elements must be >= 1, got {max_elements}")
    if length == 0:
        return []
    count = -(-length // max_elements)
    return [(start + s, n) for s, n in partition_ranges(length, count)]


def message_tag(sequence: int, index: int) -> int:
    """The point-to-point tag of message ``index`` of operation ``sequence``.

    Each message of an operation gets its own tag, so a receive can only match
    the send it was posted for. Operation numbers wrap every ``2**10``
    operations; operations on one group never overlap, so that is safe.
    """
    if not 0 <= index < 1 << TAG_INDEX_BITS:
        raise InvalidOptionError(
            f"too many messages in one operation ({index}); raise the pipeline chunk size"
        )
    return ((sequence % (1 << TAG_SEQ_BITS)) << TAG_INDEX_BITS) | index
