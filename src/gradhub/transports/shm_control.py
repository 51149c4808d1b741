"""The shared-memory transport's control segment: counters, waits, who is to blame.

Per rank, each on its own cache line:

- a progress counter, ``k * ROUNDS + r``: this rank is in operation ``k`` and
  has written ``r`` rounds of it (:data:`COMPLETE`: all of them). Operations
  are numbered from 1, so a counter below ``k * ROUNDS`` says the rank has not
  entered operation ``k``;
- a "done" counter: the last operation whose reads this rank finished (for
  vectors read in place);
- two exposure flags, one per region set: which shared vector the rank
  exposes in the operation using that set (0: none, its region).

Waiting: ``futex`` waits on a counter in the kernel (no spinning: the ranks
may share fewer cores than there are ranks), in slices of :data:`WAIT_SLICE`
seconds; after each slice the peer's process is checked through a ``pidfd``:
a dead peer is a :class:`~gradhub.errors.WorkerFailedError` naming its rank
and pid, and a peer that is alive but late past the operation's deadline a
:class:`~gradhub.errors.CollectiveTimeoutError` naming it. A futex compares
the low 32 bits of a counter; two values a waiter could see differ there,
as a rank is never more than one operation ahead of another.

Memory ordering: a counter is stored after the data it publishes; x86-64
keeps stores in order, and the ``futex`` system calls on both sides are full
barriers.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import select
from collections.abc import Sequence

from gradhub._shm.futex import futex_wait, futex_wake
from gradhub.errors import CollectiveTimeoutError, WorkerFailedError
from gradhub.transports.group import CollectiveGroup, Operation
from gradhub.transports.shm_setup import died_error, late_error

WAIT_SLICE = 0.1
"""Seconds a futex wait sleeps before the peer's process is checked again."""

ROUNDS = 1 << 20
"""Progress values per operation: an operation writes fewer rounds than this."""
COMPLETE = ROUNDS - 1
"""The round count of a rank that has written everything of an operation."""

_LINE = 64  # bytes per counter: one cache line each
_STRIDE = _LINE // 8


def control_bytes(size: int) -> int:
    """Bytes of the control segment of ``size`` ranks (progress, done, 2 x exposed)."""
    return max(4096, 4 * size * _LINE)


class Control:
    """This rank's view of the control segment of ``ranks`` (group ranks, by local index).

    Opens a ``pidfd`` of every other rank's process (``pids``, by local
    index); :meth:`close` closes them and releases the segment's buffer.
    """

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
        for i, pid in enumerate(self.pids):
            if i != self.index:
                try:
                    self._pidfds[i] = os.pidfd_open(pid)
                except ProcessLookupError:
                    self.close()
                    raise self.died(op, i, "set-up") from None
        self._counters = (ctypes.c_int64 * (4 * self.size * _STRIDE)).from_buffer(segment)
        self._base = ctypes.addressof(self._counters)

    # ------------------------------------------------------------- progress
    def mark(self, k: int, rounds: int, *, wake: bool = True) -> None:
        """Say this rank has written ``rounds`` rounds of operation ``k`` (``wake``:
        wake the ranks waiting for it; the mark of entering needs none, as
        every operation ends with a waking :data:`COMPLETE` mark)."""
        self._counters[self.index * _STRIDE] = k * ROUNDS + rounds  # one aligned 8-byte store
        if wake:
            futex_wake(self._address(self.index))

    def ready(self, k: int, rounds: int) -> bool:
        """Whether every other rank has written ``rounds`` rounds of operation ``k``."""
        target, counters = k * ROUNDS + rounds, self._counters
        return all(counters[j * _STRIDE] >= target for j in range(self.size) if j != self.index)

    def wait(self, op: Operation, k: int, rounds: int, during: str) -> None:
        """Sleep until every other rank has written ``rounds`` rounds of operation ``k``."""
        target = k * ROUNDS + rounds
        for j in range(self.size):
            if j != self.index and self._counters[j * _STRIDE] < target:
                self._sleep_until(op, k, j, j, target, during)

    # ---------------------------------------------- vectors read in place
    def set_flag(self, k: int, vector: int) -> None:
        """Expose shared vector ``vector`` (0: none) in operation ``k``."""
        self._counters[self._flag(k, self.index)] = vector

    def flags(self, k: int) -> list[int]:
        """Every rank's exposure flag of operation ``k``."""
        return [self._counters[self._flag(k, j)] for j in range(self.size)]

    def _flag(self, k: int, j: int) -> int:
        return (2 * self.size + (k % 2) * self.size + j) * _STRIDE

    def finish(self, op: Operation, k: int, during: str, exposed: bool) -> None:
        """Say this rank is done reading operation ``k``; if ``exposed``, wait until
        every rank is (then nothing reads this rank's vector any more)."""
        done = self.size
        self._counters[(done + self.index) * _STRIDE] = k
        futex_wake(self._address(done + self.index))
        for j in range(self.size) if exposed else ():
            if j != self.index and self._counters[(done + j) * _STRIDE] < k:
                self._sleep_until(op, k, j, done + j, k, during)

    # ---------------------------------------------------------------- waits
    def _address(self, line: int) -> int:
        return self._base + line * _LINE

    def _sleep_until(
        self, op: Operation, k: int, j: int, line: int, target: int, during: str
    ) -> None:
        """Sleep until counter ``line`` reaches ``target`` in operation ``k``; local
        rank ``j`` is the one named if it does not."""
        counters, slot = self._counters, line * _STRIDE
        address = self._address(line)
        while True:
            seen = counters[slot]
            if seen >= target:
                return
            remaining = op.remaining()
            if remaining <= 0:
                raise self.late(op, k, j)
            futex_wait(address, seen, min(WAIT_SLICE, remaining))
            if counters[slot] < target and not self._alive(j):
                raise self.died(op, j, during)

    def _alive(self, j: int) -> bool:
        poller = select.poll()
        poller.register(self._pidfds[j], select.POLLIN)
        return not poller.poll(0)  # a pidfd is readable once its process exited

    # ---------------------------------------------------------------- errors
    def late(self, op: Operation, k: int, j: int) -> CollectiveTimeoutError:
        """``op`` (this transport's operation ``k``) ran out of time waiting on local
        rank ``j``. The counters are this transport's check-ins: a rank whose
        progress is below ``k``'s has not entered it."""
        entered = k * ROUNDS
        counters = self._counters
        behind = [self.ranks[i] for i in range(self.size) if counters[i * _STRIDE] < entered]
        return late_error(self.group, op, behind, self.ranks[j])

    def died(self, op: Operation, j: int, during: str) -> WorkerFailedError:
        pid = self.pids[j] if j < len(self.pids) else None
        return died_error(self.group, op, self.ranks[j], pid, during)

    def close(self) -> None:
        """Close the pidfds and release the segment's buffer. Idempotent."""
        self._counters = (ctypes.c_int64 * 0)()
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
