"""Reduce-scatter and all-gather through shared memory, for ranks on one host.

Memory: the lowest rank (the leader) creates anonymous ``memfd`` segments and
hands them to the other ranks over an abstract-namespace Unix socket whose
random name is published in the group's c10d store (:mod:`.shm_setup`); every
rank maps them (``mmap``) and views them with ``torch.frombuffer``, then
closes the descriptor. Nothing has a name in a file system, so a killed process leaves
nothing behind: the kernel frees a segment when its last mapping goes.

- A small control segment holds, per rank, each on its own cache line, a
  64-bit sequence counter, a "done" counter and two exposure flags.
- A data segment holds two sets of one region per rank (each region as large
  as the vector); operation ``k`` uses set ``k % 2``. It grows (a new segment
  from the leader, sent over the socket) when a larger vector comes; every
  rank grows at the same operation because every rank sees the same sizes.
  Memory: ``2 * ranks * (largest vector in bytes)`` per host, resident once
  touched, until the group closes.

Algorithm (one synchronisation per operation):

1. Each rank writes what the other ranks need into its region of set ``k % 2``
   (reduce-scatter: every chunk but its own; all-gather: its own slice;
   broadcast: the root its tensor's bytes, the others nothing), then
   stores ``k`` in its counter and wakes the waiters.
2. It waits until every other counter reaches ``k``.
3. Reduce-scatter: it sums its own chunk from every rank's region in
   :func:`.schedule.reduction_order` (its own values, read where they lie,
   last). All-gather: it copies (decodes) every rank's slice out. Broadcast:
   it copies the root's bytes out.

Operation ``k + 2`` reuses set ``k % 2``; a rank gets there only after every
counter reached ``k + 1``, i.e. after every rank finished reading operation
``k``. So one synchronisation per operation suffices.

Bits: the sums are those of the ring (:mod:`.p2p_ring`) for every codec. With
``hop=True`` (the ring's point-to-point path) a lossy codec rounds the partial
sum once per hop, as the ring does, and ``"fp16"`` divides by the number of
ranks before and multiplies after; with ``hop=False`` (the collective path
used for small vectors) every contribution is rounded once. The all-gather
decodes the owner's wire values on every rank. Memory ordering: a counter is
stored after the data it publishes; x86-64 keeps stores in order, and the
``futex`` system calls on both sides are full barriers.

Vectors read in place (:meth:`ShmTransport.shared_vector`, which
``AllReduceParameter``'s flat buffers are): a reduce-scatter sums the ranks'
vectors where they lie (same order, same bits), an all-gather copies each
owner's slice out of the owner's vector. Each ends with a second
synchronisation ("done" counters), so on return no rank reads this rank's
vector any more and the caller may write it.

Waiting: ``futex`` waits on the peer's counter in the kernel (no spinning:
the ranks may share fewer cores than there are ranks), in slices of
:data:`WAIT_SLICE` seconds; after each slice the peer's process is checked
through a ``pidfd``: a dead peer is a
:class:`~gradhub.errors.WorkerFailedError` naming its rank and pid, and a peer
that is alive but late past the operation's deadline a
:class:`~gradhub.errors.CollectiveTimeoutError` naming it. Either breaks the
group, as on the ring.

Cost: with ``h`` the bytes of half the vector (2 ranks), an in-place
reduce-scatter + all-gather reads and writes, per rank, ``9 h``: the other
half into shared memory (``h`` read, ``h`` written), the sum of its own half
(``2 h`` read, ``h`` written), its sum into shared memory and the peer's sum
out (``2 h`` read, ``2 h`` written). That is the least two separate calls on
private tensors allow (each must publish what the peer needs and fetch what
it publishes), so the time is memory bandwidth: ``benchmarks/collectives.py``
prints the floor ``4.5 h / C`` (C: this machine's one-thread copy rate)
beside the measured time; vectors read in place need ``5 h``: ``2.5 h / C``.
Profiled (py-spy, 16M fp32), the worker thread spends two thirds of its
samples in the copies and the add (a copy into shared memory costs more than
the add), 12-22% in futex waits, 8% idle between operations (thread
hand-offs), the rest in Python.

Linux only (``memfd_create``, ``pidfd_open``, ``futex``), x86-64 or aarch64.
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
from collections.abc import Sequence

import torch

from gradhub import codecs
from gradhub._shm.futex import futex_wait, futex_wake
from gradhub._shm.memory import Mapping, forgetting_views, supported
from gradhub.errors import ClosedError, CollectiveTimeoutError, WorkerFailedError
from gradhub.transports.base import Chunking, Ranges, Transport
from gradhub.transports.group import CollectiveGroup, Operation
from gradhub.transports.schedule import add_in_order, reduction_order
from gradhub.transports.shm_setup import (
    Joined,
    SharedVectors,
    died_error,
    join,
    late_error,
    share_segment,
)

_log = logging.getLogger("gradhub.collective")

WAIT_SLICE = 0.1
"""Seconds a futex wait sleeps before the peer's process is checked again."""

_LINE = 64  # bytes per counter: one cache line each
_STRIDE = _LINE // 8
_ALIGN = 4096
_MIN_CAPACITY = 1 << 20

Segments = Sequence[Sequence[tuple[int, int]]]
"""``owned[i]``: the ``(start, length)`` segments local rank ``i`` owns."""


class ShmTransport(Transport):
    """Shared-memory reduce-scatter, all-gather and broadcast among the ranks of one host.

    ``ranks``: the group ranks that share this host, ascending; this process is
    one of them. Set up collectively (every rank in ``ranks`` constructs it at
    the same operation); :meth:`close` unmaps everything (idempotent).
    """

    name = "shm"
    checks_in = False  # the counters say who entered an operation

    def __init__(self, group: CollectiveGroup, ranks: Sequence[int], op: Operation, key: str):
        if not supported():
            raise RuntimeError("shared-memory transport needs Linux with memfd, pidfd and futex")
        super().__init__(group)
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        self.index = self.ranks.index(group.rank)
        self._sequence = 0
        self._capacity = 0
        self._data: Mapping | None = None
        self._joined = Joined()
        self._pidfds: dict[int, int] = {}
        self._closed = False
        self._counters: ctypes.Array[ctypes.c_int64] = (ctypes.c_int64 * 0)()
        self._base = 0
        self._op = op
        self._shared = SharedVectors()
        try:
            control_bytes = max(_ALIGN, 4 * self.size * _LINE)  # entered, done, 2 x exposed
            self._joined = join(
                group, self.ranks, op, key, control_bytes, self._died_now, self._setup_timeout
            )
            for i, pid in enumerate(self._joined.pids):
                if i != self.index:
                    try:
                        self._pidfds[i] = os.pidfd_open(pid)
                    except ProcessLookupError:
                        raise self._died(op, i, "set-up") from None
        except BaseException:
            self.close()
            raise
        control = self._joined.control
        assert control is not None
        self._counters = (ctypes.c_int64 * (4 * self.size * _STRIDE)).from_buffer(control.mm)
        self._base = ctypes.addressof(self._counters)
        _log.debug(
            "[rank %d] shared memory with ranks %s (pids %s)",
            group.rank,
            self.ranks,
            self._joined.pids,
        )

    # -------------------------------------------------------- the interface
    def reduce_scatter(
        self,
        op: Operation,
        flat: torch.Tensor,
        codec: codecs.Codec,
        ranges: Ranges,
        out: torch.Tensor,
        chunking: Chunking,
    ) -> None:
        hop = not chunking.small(flat.numel(), codec)  # round as the ring would
        self.reduce_scatter_segments(op, flat, codec, [[c] for c in ranges], out, hop=hop)

    def all_gather(
        self,
        op: Operation,
        own_wire: torch.Tensor,
        codec: codecs.Codec,
        ranges: Ranges,
        out: torch.Tensor,
        chunking: Chunking,
    ) -> None:
        self.all_gather_segments(op, own_wire, codec, [[c] for c in ranges], out)

    # ------------------------------------------------- vectors read in place
    def shared_vector(self, op: Operation, numel: int) -> torch.Tensor:
        """A new fp32 vector of ``numel`` elements in a segment every rank maps
        (collective: every rank calls it at the same operation). Reduce-scatters
        and all-gathers of it read the other ranks' vectors in place (see the
        module docstring); any other use of it works as of a private tensor."""
        self._next(op, count=False)  # not numbered: it publishes nothing
        return self._shared.make(self._joined, self.index, op, numel, self._died_now, self._late)

    def _expose(self, k: int, tensor: torch.Tensor, plain: bool) -> bool:
        """Say whether the other ranks read ``tensor`` in place in operation ``k``
        (it is this rank's whole shared vector and the wire holds fp32) or this
        rank's region. One flag per rank and set ``k % 2``, as the regions."""
        vector = self._shared.id_of(tensor, self.index) if plain else 0
        self._counters[self._flag(k, self.index)] = vector
        return vector != 0

    def _flag(self, k: int, j: int) -> int:
        return (2 * self.size + (k % 2) * self.size + j) * _STRIDE

    def _sources(self, k: int, regions: list[torch.Tensor]) -> list[torch.Tensor]:
        """Where each rank's values of operation ``k`` lie: its vector or its region."""
        flags = [self._counters[self._flag(k, j)] for j in range(self.size)]
        return [self._shared.vector(f, j) if f else regions[j] for j, f in enumerate(flags)]

    def _finish(self, op: Operation, k: int, during: str, exposed: bool) -> None:
        """Say this rank is done reading operation ``k``; if ``exposed``, wait until
        every rank is (then nothing reads this rank's vector any more)."""
        done = self.size * _STRIDE
        self._counters[done + self.index * _STRIDE] = k
        futex_wake(self._address(self.size + self.index))
        for j in range(self.size) if exposed else ():
            if j != self.index and self._counters[done + j * _STRIDE] < k:
                self._sleep_until(op, j, k, during, self.size + j)

    @forgetting_views
    def broadcast(self, op: Operation, tensor: torch.Tensor, root: int) -> None:
        raw = tensor.view(-1).view(torch.uint8)
        k, regions = self._begin(op, raw.numel(), torch.uint8)
        source = self.ranks.index(root)
        if self.index == source:
            regions[source].copy_(raw)
        self._publish(k)
        self._wait_all(op, k, "broadcast")
        if self.index != source:
            raw.copy_(regions[source])
        del regions

    # ------------------------------------------------ segments (hierarchical)
    @forgetting_views
    def reduce_scatter_segments(
        self,
        op: Operation,
        flat: torch.Tensor,
        codec: codecs.Codec,
        owned: Segments,
        out: torch.Tensor,
        *,
        hop: bool,
    ) -> None:
        """Sum this rank's segments of ``flat`` over the ranks into ``out``.

        ``owned[i]``: the ``(start, length)`` segments of ``flat`` that local
        rank ``i`` sums (one each for a plain reduce-scatter; several for
        :mod:`.hierarchical`); ``out`` receives this rank's segments' sums back
        to back, and may be its one segment of ``flat`` itself. ``hop``: round
        like the ring's point-to-point path (see the module docstring).
        """
        P, me = self.size, self.index
        plain = isinstance(codec, codecs.NoCompression)
        prescale = hop and codec.wire_dtype == torch.float16
        dtype = torch.float32 if plain or hop else codec.wire_dtype
        k, regions = self._begin(op, flat.numel(), dtype)
        mine = regions[me]
        exposed = self._expose(k, flat, plain)
        for c, segments in enumerate(owned if not exposed else ()):
            for s, n in segments if c != me else ():
                if n == 0:
                    continue
                if prescale:
                    torch.div(flat[s : s + n], P, out=mine[s : s + n])
                elif plain or hop:
                    mine[s : s + n].copy_(flat[s : s + n])
                else:
                    mine[s : s + n].copy_(codec.encode(flat[s : s + n]))
        self._publish(k)
        self._wait_all(op, k, "reduce_scatter")
        sources = self._sources(k, regions)
        order = reduction_order(me, P)  # this rank last
        at = 0
        for s, n in owned[me]:
            parts = [sources[j][s : s + n] for j in order[:-1]]
            scratch = self.group.scratch("shm_acc", n, torch.float32)
            add_in_order(parts, flat[s : s + n], codec, out[at : at + n], hop=hop, scratch=scratch)
            at += n
            del parts
        del regions, mine, sources
        self._finish(op, k, "reduce_scatter", exposed)

    @forgetting_views
    def all_gather_segments(
        self,
        op: Operation,
        own_wire: torch.Tensor,
        codec: codecs.Codec,
        owned: Segments,
        out: torch.Tensor,
    ) -> None:
        """Every rank's encoded segments, decoded into their places in ``out`` (flat fp32).

        ``owned[i]``: local rank ``i``'s segments of ``out``; ``own_wire``
        holds this rank's, back to back.
        """
        me = self.index
        plain = isinstance(codec, codecs.NoCompression)
        k, regions = self._begin(op, out.numel(), codec.wire_dtype)
        exposed = self._expose(k, out, plain)
        at = 0
        for s, n in owned[me]:  # into the region, or into place in the exposed vector
            into = out[s : s + n] if exposed else regions[me][s : s + n]
            if into.data_ptr() != own_wire[at:].data_ptr():
                into.copy_(own_wire[at : at + n])
            at += n
        self._publish(k)
        at = 0
        for s, n in owned[me] if not exposed else ():
            wire, own_out = own_wire[at : at + n], out[s : s + n]
            at += n
            if n and not (plain and wire.data_ptr() == own_out.data_ptr()):
                own_out.copy_(wire if plain else codec.decode(wire))
        self._wait_all(op, k, "all_gather")
        sources = self._sources(k, regions)
        for c, segments in enumerate(owned):
            for s, n in segments if c != me else ():
                if n == 0:
                    continue
                part = sources[c][s : s + n]
                out[s : s + n].copy_(part if plain else codec.decode(part))
        del regions, sources
        self._finish(op, k, "all_gather", exposed)

    # -------------------------------------------------------- synchronisation
    def _begin(
        self, op: Operation, numel: int, dtype: torch.dtype
    ) -> tuple[int, list[torch.Tensor]]:
        """Number the operation, grow the data segment if needed, and return
        the regions of this operation's set as ``numel``-element views."""
        k = self._next(op)
        itemsize = torch.empty((), dtype=dtype).element_size()
        need = -(-max(numel * itemsize, 1) // _ALIGN) * _ALIGN
        if need > self._capacity:
            self._grow(op, max(need, 2 * self._capacity, _MIN_CAPACITY))
        assert self._data is not None and self._data.bytes is not None
        base = (k % 2) * self.size * self._capacity
        data = self._data.bytes
        regions = [
            data[base + i * self._capacity : base + i * self._capacity + numel * itemsize].view(
                dtype
            )
            for i in range(self.size)
        ]
        return k, regions

    def _next(self, op: Operation, *, count: bool = True) -> int:
        """The number of operation ``op`` (refused once closed)."""
        if self._closed:
            raise ClosedError(
                f"[rank {self.group.rank}] {op.name}: the shared-memory transport is closed"
            )
        self._op = op
        self._sequence += count
        return self._sequence

    def _grow(self, op: Operation, capacity: int) -> None:
        leader = self.index == 0
        mapping = share_segment(
            self._joined, leader, op, 2 * self.size * capacity, self._died_now, self._late
        )
        if self._data is not None:
            self._data.close()
        self._data, self._capacity = mapping, mapping.size // (2 * self.size)

    def _publish(self, k: int) -> None:
        self._counters[self.index * _STRIDE] = k  # one aligned 8-byte store
        futex_wake(self._address(self.index))

    def _address(self, index: int) -> int:
        return self._base + index * _LINE

    def _wait_all(self, op: Operation, k: int, during: str) -> None:
        counters = self._counters
        for j in range(self.size):
            if j != self.index and counters[j * _STRIDE] < k:
                self._sleep_until(op, j, k, during)

    def _sleep_until(
        self, op: Operation, j: int, k: int, during: str, line: int | None = None
    ) -> None:
        """Sleep until counter ``line`` (default: rank ``j``'s entered counter)
        reaches ``k``; rank ``j`` is the one named if it does not."""
        line = j if line is None else line
        counters, slot = self._counters, line * _STRIDE
        address = self._address(line)
        while True:
            seen = counters[slot]
            if seen >= k:
                return
            remaining = op.remaining()
            if remaining <= 0:
                raise self._late(j)
            futex_wait(address, seen, min(WAIT_SLICE, remaining))
            if counters[slot] < k and not self._alive(j):
                raise self._died(op, j, during)

    def _alive(self, j: int) -> bool:
        poller = select.poll()
        poller.register(self._pidfds[j], select.POLLIN)
        return not poller.poll(0)  # a pidfd is readable once its process exited

    # ---------------------------------------------------------------- errors
    def _late(self, j: int) -> CollectiveTimeoutError:
        """The counters are this transport's check-ins: a rank whose counter is
        behind this operation's number has not entered it."""
        k, counters = self._sequence, self._counters
        behind = [self.ranks[i] for i in range(self.size) if counters[i * _STRIDE] < k]
        return late_error(self.group, self._op, behind, self.ranks[j])

    def _died_now(self, j: int, during: str) -> WorkerFailedError:
        return self._died(self._op, j, during)

    def _died(self, op: Operation, j: int, during: str) -> WorkerFailedError:
        pids = self._joined.pids
        pid = pids[j] if j < len(pids) else None
        return died_error(self.group, op, self.ranks[j], pid, during)

    def _setup_timeout(self, missing: list[int]) -> CollectiveTimeoutError:
        return self.group.timed_out(self._op, missing[0] if len(missing) == 1 else None)

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Unmap the segments, close sockets and pidfds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._counters = (ctypes.c_int64 * 0)()  # releases the control mapping's buffer
        self._shared.close()
        for mapping in (self._data, self._joined.control):
            if mapping is not None:
                mapping.close()
        self._data = self._joined.control = None
        self._joined.close()
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()
