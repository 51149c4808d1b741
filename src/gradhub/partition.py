"""Slice math for a flat parameter split over ``num_partitions`` owners.

The split follows BigDL's rule: with ``q, r = divmod(size, P)``, partition ``p``
starts at ``p*q + min(p, r)`` and holds ``q + (1 if p < r else 0)`` elements.
The first ``size % P`` partitions are one longer; with ``size < P`` the last
partitions are empty, which every caller must handle.
"""

from __future__ import annotations

from gradhub.errors import InvalidOptionError


def _validate(size: int, num_partitions: int) -> None:
    if size < 0:
        raise InvalidOptionError(f"size must be >= 0, got {size}")
    if num_partitions < 1:
        raise InvalidOptionError(f"num_partitions must be >= 1, got {num_partitions}")


def partition_range(size: int, num_partitions: int, partition_id: int) -> tuple[int, int]:
    """Return ``(start, length)`` of partition ``partition_id``."""
    _validate(size, num_partitions)
    if not 0 <= partition_id < num_partitions:
        raise InvalidOptionError(
            f"partition_id must be in [0, {num_partitions}), got {partition_id}"
        )
    q, r = divmod(size, num_partitions)
    return partition_id * q + min(partition_id, r), q + (1 if partition_id < r else 0)


def partition_ranges(size: int, num_partitions: int) -> list[tuple[int, int]]:
    """Return ``(start, length)`` for every partition, in order."""
    _validate(size, num_partitions)
    return [partition_range(size, num_partitions, p) for p in range(num_partitions)]


def segment_ranges(
    size: int, num_partitions: int, offset: int, length: int
) -> list[tuple[int, int]]:
    """Where each partition's part of the segment ``[offset, offset + length)`` of the
    flat vector lies in that segment: ``(start in the segment, length)`` per
    partition, back to back in partition order and covering the segment (a
    partition with nothing there gets an empty range at its place)."""
    _validate(size, num_partitions)
    if offset < 0 or length < 0 or offset + length > size:
        raise InvalidOptionError(f"segment [{offset}, {offset + length}) is not inside [0, {size})")
    out = []
    for s, n in partition_ranges(size, num_partitions):
        a, b = max(s, offset), min(s + n, offset + length)
        out.append((a - offset, b - a) if b > a else (min(max(s - offset, 0), length), 0))
    return out
