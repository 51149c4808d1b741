"""The shared-memory transport's control segment: counters, waits, who is to blame.

Per rank, each on its own cache line: a sequence counter (the last operation
it entered, its data published), a "done" counter (the last operation whose
reads it finished), and per region set (operation ``k`` uses set ``k % 2``)
an exposure flag (which shared vector it exposes, 0: none) and an address
(where the other ranks read its all-gather slice in its own memory, 0:
in its region); and a line for the set-up's handshake.

Waiting: a waiter first polls the counter for at most :data:`SPIN` seconds
(a peer running on another core gets there within microseconds, and a
sleeper's wake-up costs tens of them), and only while polling pays: a poll
that runs out makes the next waits sleep at once, more of them after each
miss in a row, so where the ranks share fewer cores than there are ranks
(a busy machine) a waiter hardly polls and leaves the core to its peer.
Then ``futex`` waits on the counter in the kernel, in slices of
:data:`WAIT_SLICE` seconds; after each slice every peer's process is checked
through a ``pidfd`` (not only the one waited on, which may itself have left
for another's death):
a dead peer is a :class:`~gradhub.errors.WorkerFailedError` naming its rank
and pid (so is one that closed its side while another still waits on it: its
"left" line), and a peer that is alive but late past the operation's deadline a
:class:`~gradhub.errors.CollectiveTimeoutError` naming it. Either breaks the
group, as on the ring.

Memory ordering: a counter is stored after the data it publishes and read
before them; x86-64 keeps stores in order and loads in order, and the
``futex`` system calls on both sides are full barriers.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import select
import time
from collections.abc import Sequence

import torch

from gradhub._shm import cma, native
from gradhub._shm.futex import futex_wait, futex_wake
from gradhub.errors import CollectiveTimeoutError, WorkerFailedError
from gradhub.transports.group import CollectiveGroup, Operation
from gradhub.transports.shm_setup import died_error, late_error

WAIT_SLICE = 0.1
SPIN = 50e-6 if platform.machine() == "x86_64" else 0.0
"""Seconds a waiter polls a counter before it sleeps on it (see the module
docstring). x86-64 only: a poll reads the counter and then the data with plain
loads, which x86-64 keeps in order; elsewhere the futex calls are the barriers."""
_MISSES = 8
"""At most ``2**8 - 1`` waits in a row sleep at once after polls that ran out."""
"""Seconds a futex wait sleeps before the peer's process is checked again."""

_LINE = 64  # bytes per counter: one cache line each
_STRIDE = _LINE // 8
ENTERED, DONE, FLAG, ADDRESS, HELLO, LEFT = 0, 1, 2, 4, 6, 7  # FLAG, ADDRESS: + k % 2
_KINDS = 8


def control_bytes(size: int) -> int:
    """Bytes of the control segment of ``size`` ranks."""
    return max(4096, _KINDS * size * _LINE)


class Control:
    """This rank's view of the control segment of ``ranks`` (group ranks, by local
    index), whose processes are ``pids``. Opens a ``pidfd`` of every other rank's
    process; :meth:`close` closes them and releases the segment's buffer."""

    def __init__(
        self,
        group: CollectiveGroup,
        ranks: Sequence[int],
        pids: Sequence[int],
        segment: mmap.mmap,
        op: Operation,
    ):
        self.group, self.ranks, self.pids = group, list(ranks), list(pids)
        self.size = len(self.ranks)
        self.index = self.ranks.index(group.rank)
        self._pidfds: dict[int, int] = {}
        self._misses = 0  # polls run out in a row (see _spun)
        self._skip = 0  # waits left that sleep at once
        self._counters = (ctypes.c_int64 * (_KINDS * self.size * _STRIDE)).from_buffer(segment)
        self._base = ctypes.addressof(self._counters)
        peer = (self.index + 1) % self.size  # of two ranks, the other one
        self._pair_lines = (self.address(ENTERED, self.index), self.address(ENTERED, peer))
        """The addresses of this rank's and the peer's ``ENTERED`` lines (the C calls')."""
        self._poller = select.poll()
        self._index_of: dict[int, int] = {}
        for i, pid in enumerate(self.pids):
            if i != self.index:
                try:
                    self._pidfds[i] = os.pidfd_open(pid)
                except ProcessLookupError:
                    self.close()
                    raise self.died(op, i, "set-up") from None
                self._poller.register(self._pidfds[i], select.POLLIN)
                self._index_of[self._pidfds[i]] = i

    # ---------------------------------------------------------------- lines
    def _slot(self, kind: int, j: int) -> int:
        return (kind * self.size + j) * _STRIDE

    def get(self, kind: int, j: int) -> int:
        return int(self._counters[self._slot(kind, j)])

    def set(self, kind: int, value: int) -> None:
        """Store ``value`` in this rank's line ``kind`` (no wake)."""
        self._counters[self._slot(kind, self.index)] = value

    def publish(self, kind: int, value: int) -> None:
        """Store ``value`` in this rank's line ``kind`` and wake its waiters."""
        self._counters[self._slot(kind, self.index)] = value  # one aligned 8-byte store
        futex_wake(self._base + self._slot(kind, self.index) * 8)

    def address(self, kind: int, j: int) -> int:
        """The address of rank ``j``'s line ``kind``."""
        return self._base + self._slot(kind, j) * 8

    def wait_all(
        self, op: Operation, k: int, kind: int, value: int, during: str, *, poll: bool = True
    ) -> None:
        """Sleep until every other rank's line ``kind`` reaches ``value`` (in this
        transport's operation ``k``); ``poll=False``: without polling first (the
        caller polled)."""
        for j in range(self.size):
            if j != self.index and self.get(kind, j) < value:
                self._sleep_until(op, k, j, kind, value, during, poll)

    def finish(self, op: Operation, k: int, during: str, read_here: bool) -> None:
        """Say this rank is done reading operation ``k``; if the others read this
        rank's own memory (``read_here``), wait until every rank is."""
        self.publish(DONE, k)
        if read_here:
            self.wait_all(op, k, DONE, k, during)

    def cross_reads(self, op: Operation) -> bool:
        """Whether every rank may read every other rank's memory (:mod:`.cma`),
        agreed at set-up (collective): each rank shows the others a line whose
        value is its own address, and says whether it could read theirs."""
        me = self._base + self._slot(ADDRESS, self.index) * 8
        self.set(ADDRESS, me)
        self.publish(HELLO, 1)
        self.wait_all(op, 0, HELLO, 1, "set-up")
        readable = all(
            cma.readable(self.pids[j], a, torch.tensor([a], dtype=torch.int64))
            for j in range(self.size)
            if j != self.index
            for a in [self.get(ADDRESS, j)]
        )
        self.publish(HELLO, 2 if readable else 3)
        self.wait_all(op, 0, HELLO, 2, "set-up")
        return all(self.get(HELLO, j) == 2 for j in range(self.size))

    def all_reduce_pair(
        self, op: Operation, k: int, flat: torch.Tensor, regions: list[torch.Tensor]
    ) -> None:
        """Two ranks' one-synchronisation all-reduce of ``flat`` (operation ``k``,
        through ``regions``) in one C call (:func:`gradhub._shm.native.all_reduce_pair`),
        polling as :meth:`_spun` does; where the peer is not there by the end of
        the poll, the wait here (which names a dead peer), then the addition."""
        budget = self.poll_budget()
        mine, theirs = self._pair_lines
        reached = native.all_reduce_pair(flat, regions, self.index, mine, theirs, k, budget)
        if budget > 0:
            self.polled(reached)
        if not reached:
            self.wait_all(op, k, ENTERED, k, "all_reduce", poll=False)
            native.sum_pair(regions, flat)

    def all_reduce_halves(
        self,
        op: Operation,
        k: int,
        flat: torch.Tensor,
        first: list[torch.Tensor],
        second: list[torch.Tensor],
    ) -> None:
        """Two ranks' all-reduce of ``flat`` in halves, operations ``k`` and ``k +
        1`` (through the regions ``first`` and ``second``), in C
        (:func:`gradhub._shm.native.all_reduce_halves`; where a poll runs out,
        the wait here, which names a dead peer, then the C part goes on), or
        its same steps here where the C part is not loaded (a peer may run
        either: the same memory, counters and bits)."""
        if not native.loaded():
            return self._halves(op, k, flat, first, second)
        mine, theirs = self._pair_lines
        stage = 0
        while True:
            budget = self.poll_budget()
            at = native.all_reduce_halves(
                flat, first, second, self.index, mine, theirs, k, budget, stage
            )
            if budget > 0:
                self.polled(at == 3)
            if at == 3:
                return
            stage = at
            self.wait_all(op, k + at - 1, ENTERED, k + at - 1, "all_reduce", poll=False)

    def _halves(
        self,
        op: Operation,
        k: int,
        flat: torch.Tensor,
        first: list[torch.Tensor],
        second: list[torch.Tensor],
    ) -> None:
        """:meth:`all_reduce_halves` with Python's waits and ATen's copies and
        addition (of two values, ATen rounds once, as the C sum)."""
        me, peer, half = self.index, 1 - self.index, (flat.numel() + 1) // 2
        mine, theirs = (slice(0, half), slice(half, None))[:: 1 if me == 0 else -1]
        first[me][theirs].copy_(flat[theirs])
        self.publish(ENTERED, k)
        self.wait_all(op, k, ENTERED, k, "all_reduce")
        own = flat[mine]
        torch.add(own, first[peer][mine], out=own)
        second[me][mine].copy_(own)
        self.publish(ENTERED, k + 1)
        self.wait_all(op, k + 1, ENTERED, k + 1, "all_reduce")
        flat[theirs].copy_(second[peer][theirs])

    # ---------------------------------------------------------------- waits
    def _sleep_until(
        self, op: Operation, k: int, j: int, kind: int, value: int, during: str, poll: bool
    ) -> None:
        """Sleep until rank ``j``'s line ``kind`` reaches ``value``; rank ``j`` is
        the one named if it does not."""
        counters, slot = self._counters, self._slot(kind, j)
        if poll and self._spun(counters, slot, value):
            return
        address = self._base + slot * 8
        while True:
            seen = counters[slot]
            if seen >= value:
                return
            remaining = op.remaining()
            if remaining <= 0:
                raise self.late(op, k, j)
            futex_wait(address, seen, min(WAIT_SLICE, remaining))
            if counters[slot] < value:
                dead = self.first_dead()
                if dead is not None:
                    raise self.died(op, dead, during)
                gone = [i for i in range(self.size) if i != self.index and self.get(LEFT, i)]
                if gone:  # it closed the group, which it left for another's death
                    raise self.died(op, gone[0], during)

    def _spun(self, counters: ctypes.Array[ctypes.c_int64], slot: int, value: int) -> bool:
        """Poll line ``slot`` for at most :data:`SPIN` seconds; whether it reached
        ``value``. A poll that runs out (the peer is not running: the machine is
        busy, or the peer is elsewhere in its program) makes the next
        ``2**misses - 1`` waits sleep at once (see :data:`_MISSES`), so on a
        busy machine a waiter hardly polls and leaves the core to others."""
        budget = self.poll_budget()
        if budget <= 0:
            return False
        clock = time.perf_counter
        end = clock() + budget
        while counters[slot] < value:
            if clock() > end:
                self.polled(False)
                return False
        self.polled(True)
        return True

    def poll_budget(self) -> float:
        """Seconds the next wait may poll before it sleeps (0: none; see :meth:`_spun`)."""
        if self._skip:
            self._skip -= 1
            return 0.0
        return SPIN

    def polled(self, reached: bool) -> None:
        """Count a poll that reached its value or ran out (see :meth:`_spun`)."""
        if reached:
            self._misses = max(self._misses - 1, 0)
        else:
            self._misses = min(self._misses + 1, _MISSES)
            self._skip = (1 << self._misses) - 1

    def alive(self, j: int) -> bool:
        poller = select.poll()
        poller.register(self._pidfds[j], select.POLLIN)
        return not poller.poll(0)  # a pidfd is readable once its process exited

    def first_dead(self) -> int | None:
        """The lowest index of a peer whose process exited, else ``None``. Every
        peer is checked, not only the one waited on: a survivor may wait on a
        peer that itself left this operation for another's death."""
        ready = self._poller.poll(0)  # a pidfd is readable once its process exited
        if not ready:
            return None
        return min(self._index_of[fd] for fd, _ in ready)

    # --------------------------------------------------------------- errors
    def late(self, op: Operation, k: int, j: int) -> CollectiveTimeoutError:
        """``op`` (this transport's operation ``k``) ran out of time waiting on
        rank ``j``. The counters are this transport's check-ins: a rank whose
        counter is behind ``k`` has not entered it."""
        behind = [self.ranks[i] for i in range(self.size) if self.get(ENTERED, i) < k]
        return late_error(self.group, op, behind, self.ranks[j])

    def died(
        self, op: Operation, j: int, during: str
    ) -> WorkerFailedError | CollectiveTimeoutError:
        pid = self.pids[j] if j < len(self.pids) else None
        return died_error(self.group, op, self.ranks[j], pid, during)

    def close(self) -> None:
        """Say this rank has left (a peer still waiting on it fails at once instead
        of at its deadline: a survivor that left for another's death, whom a rank
        of its host still waits on), close the pidfds, release the buffer. Idempotent."""
        if len(self._counters):
            self._counters[self._slot(LEFT, self.index)] = 1
            for slot in range(0, len(self._counters), _STRIDE):
                futex_wake(self._base + slot * 8)
        self._counters = (ctypes.c_int64 * 0)()
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
