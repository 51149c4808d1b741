"""PriorityLanes: the one queue discipline of the parameter servers and their client.

Items are queued in *lanes* (for the servers and the client: one lane per key,
or per connection and key). The contract, tested by property tests:

1. **One lane's items never overtake each other**: :meth:`pop` always returns
   the first item of some lane.
2. **Higher priority first**: the lane served next is the one holding the
   highest priority; an item lifts the items queued before it in its lane to
   its own priority (priority inheritance), so an urgent item is never stuck
   behind a lane that is not served.
3. **First in, first out among equals**: of lanes whose highest priority is
   the same, the one whose item of that priority was queued first is served
   first. With one priority throughout, items leave in the order they came.

It is a heap of ``(-priority, order)`` entries, one per item, over a deque per
lane: push and pop cost ``O(log n)``; entries of items that already left (taken
ahead of time by priority inheritance, or removed by :meth:`remove_if`) are
skipped when they reach the top. Not thread-safe: its owner holds the lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

L = TypeVar("L", bound=Hashable)
T = TypeVar("T")


class PriorityLanes(Generic[L, T]):
    """Lanes of items served by priority, FIFO among equals, never reordered within a lane."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, L]] = []
        self._lanes: dict[L, deque[tuple[int, T]]] = {}
        self._live: set[int] = set()
        self._orders = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __bool__(self) -> bool:
        return bool(self._live)

    def push(self, lane: L, item: T, priority: int = 0) -> None:
        """Queue ``item`` at the end of ``lane`` with ``priority``."""
        order = next(self._orders)
        self._lanes.setdefault(lane, deque()).append((order, item))
        self._live.add(order)
        heapq.heappush(self._heap, (-priority, order, lane))

    def _top(self) -> tuple[int, int, L] | None:
        while self._heap:
            entry = self._heap[0]
            if entry[1] in self._live:
                return entry
            heapq.heappop(self._heap)
        return None

    def peek(self) -> tuple[L, T] | None:
        """The lane and item :meth:`pop` would return, left in place (``None`` if empty)."""
        top = self._top()
        if top is None:
            return None
        lane = top[2]
        return lane, self._lanes[lane][0][1]

    def pop(self) -> tuple[L, T] | None:
        """Take the next item (``None`` if empty)."""
        top = self._top()
        if top is None:
            return None
        lane = top[2]
        queue = self._lanes[lane]
        order, item = queue.popleft()
        self._live.discard(order)
        if not queue:
            del self._lanes[lane]
        return lane, item

    def remove_if(self, predicate: Callable[[T], bool]) -> list[T]:
        """Remove and return every item for which ``predicate`` is true (order kept per lane)."""
        removed: list[T] = []
        for lane in list(self._lanes):
            keep: deque[tuple[int, T]] = deque()
            for order, item in self._lanes[lane]:
                if predicate(item):
                    removed.append(item)
                    self._live.discard(order)
                else:
                    keep.append((order, item))
            if keep:
                self._lanes[lane] = keep
            else:
                del self._lanes[lane]
        return removed

    def clear(self) -> list[T]:
        """Remove and return every item."""
        return self.remove_if(lambda _item: True)

    def lane(self, lane: L) -> Iterator[T]:
        """The items queued in ``lane``, first first."""
        return (item for _, item in self._lanes.get(lane, ()))

    def __iter__(self) -> Iterator[T]:
        for queue in self._lanes.values():
            for _, item in queue:
                yield item
