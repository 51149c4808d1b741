"""The shared-memory transport's data segment: two sets of one region per rank.

Operation ``k`` uses set ``k % 2`` (see :mod:`.shm`). Each region is as large
as the largest vector so far, rounded up to whole pages; the segment grows
(a new one from the leader, :func:`.shm_setup.share_segment`) when a larger
vector comes, at the same operation on every rank because every rank sees
the same sizes. The views of an operation's regions are kept per set, size
and dtype (at most :data:`KEPT` of them): making them costs more than a
small operation's copy, and a job calls few sizes again and again.
"""

from __future__ import annotations

import torch

from gradhub._shm.memory import Mapping
from gradhub.transports.operation import Operation
from gradhub.transports.shm_setup import Died, Joined, Late, share_segment

_ALIGN = 4096
_MIN_CAPACITY = 1 << 20
KEPT = 32
"""Region views kept (per set, size and dtype) before the oldest are dropped."""


class Regions:
    """The data segment of ``size`` local ranks, this rank's ``index`` among them."""

    def __init__(self, joined: Joined, size: int, index: int):
        self._joined, self._size, self._index = joined, size, index
        self._data: Mapping | None = None
        self._capacity = 0
        self._views: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}

    def of(
        self, op: Operation, k: int, numel: int, dtype: torch.dtype, died: Died, late: Late
    ) -> list[torch.Tensor]:
        """Operation ``k``'s regions as ``numel``-element ``dtype`` views, one per
        local rank (collective when the segment grows: every rank calls it at the
        same operation with the same size)."""
        key = (k % 2, numel, dtype)
        views = self._views.get(key)
        if views is not None:
            return views
        need = -(-max(numel * dtype.itemsize, 1) // _ALIGN) * _ALIGN
        if need > self._capacity:
            self._grow(op, max(need, 2 * self._capacity, _MIN_CAPACITY), died, late)
        assert self._data is not None and self._data.bytes is not None
        data, capacity, end = self._data.bytes, self._capacity, numel * dtype.itemsize
        base = (k % 2) * self._size * capacity
        views = [
            data[base + i * capacity : base + i * capacity + end].view(dtype)
            for i in range(self._size)
        ]
        if len(self._views) >= KEPT:
            self._views.clear()
        self._views[key] = views
        return views

    def _grow(self, op: Operation, capacity: int, died: Died, late: Late) -> None:
        leader = self._index == 0
        total = 2 * self._size * capacity
        mapping = share_segment(self._joined, leader, op, total, died, late)
        self.close()
        self._data, self._capacity = mapping, mapping.size // (2 * self._size)

    def close(self) -> None:
        """Drop the views and unmap the segment (idempotent)."""
        self._views.clear()
        if self._data is not None:
            self._data.close()
            self._data = None
        self._capacity = 0
