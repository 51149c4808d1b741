"""Reduce-scatter and all-gather through shared memory, for ranks on one host.

Memory: the lowest rank (the leader) creates anonymous ``memfd`` segments and
hands them to the other ranks over an abstract-namespace Unix socket whose
random name is published in the group's c10d store (:mod:`.shm_setup`); every
rank maps them (``mmap``) and views them with ``torch.frombuffer``, then
closes the descriptor. Nothing has a name in a file system, so a killed process leaves
nothing behind: the kernel frees a segment when its last mapping goes.

- A small control segment holds, per rank, each on its own cache line, a
  64-bit sequence counter, a "done" counter, two exposure flags and two
  addresses (:mod:`.shm_control`, which also waits and names the rank that
  does not come).
- A data segment holds two sets of one region per rank (each region as large
  as the vector); operation ``k`` uses set ``k % 2`` (:mod:`.shm_regions`,
  which grows it when a larger vector comes). Memory: ``2 * ranks *
  (largest vector in bytes)`` per host, resident once touched, until the
  group closes.

Algorithm (one synchronisation per operation):

1. Each rank writes what the other ranks need into its region of set ``k % 2``
   (reduce-scatter: every chunk but its own; all-gather: its own slice, or
   nothing where the others read it in this rank's memory, below;
   broadcast: the root its tensor's bytes, the others nothing), then
   stores ``k`` in its counter and wakes the waiters.
2. It waits until every other counter reaches ``k``.
3. Reduce-scatter: it sums its own chunk from every rank's region in
   :func:`.schedule.reduction_order` (its own values, read where they lie,
   last). All-gather: it copies (decodes) every rank's slice out. Broadcast:
   it copies the root's bytes out.

Operation ``k + 2`` reuses set ``k % 2``; a rank gets there only after every
counter reached ``k + 1``, i.e. after every rank finished reading operation
``k``. So one synchronisation per operation suffices. An all-reduce of plain
values up to ``ONE_SYNC_BYTES`` (1 MiB; bf16, which the C sum adds at twice
ATen's speed: ``ONE_SYNC_BF16_BYTES``, 2 MiB) over the number of other ranks
is one operation: every rank writes its whole vector, then adds every slice
itself (:mod:`.shm_sums`, the same bits); above it, a reduce-scatter and an
all-gather. With two ranks (fp32 or bf16) and the C part loaded, the same
steps and bits are C calls (:mod:`gradhub._shm.native`): one operation up to
``PAIR_ONE_SYNC_BYTES`` (64 KiB), above it each rank adds its half (0.75x one
operation's time at 1 MiB of fp32) until halves are read in their owners'
memory (below; DDP's 25 MB buckets took 5% longer in C through the regions).
Where a poll runs out, the Python wait (which names a dead peer).

All-gather from the owners' memory: where every rank may read every other
rank's memory (``process_vm_readv``, :mod:`gradhub._shm.cma`; agreed at
set-up, as same-user processes may unless Yama's ``ptrace_scope`` or a
container forbids it), a rank all-gathering plain values whose slice holds
at least ``CROSS_READ_BYTES`` (4 MiB) publishes the address of its slice
instead of copying it into its region, and the others copy it straight into
their output: one copy instead of two. (Below that the kernel's walk of the
owner's pages costs more than the second copy: with 2 ranks a 2 MB slice
took 1.15x as long that way, a 4 MB slice 0.95x, an 8 MB one 0.85x.) It then waits, as for a vector
read in place, until every rank is done reading ("done" counters).

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

Waiting and failures: :mod:`.shm_control` (a dead peer is a
:class:`~gradhub.errors.WorkerFailedError` naming its rank and pid, a late
one a :class:`~gradhub.errors.CollectiveTimeoutError` naming it; either
breaks the group, as on the ring).

Cost: with ``h`` the bytes of half the vector (2 ranks), an in-place
reduce-scatter + all-gather through the regions reads and writes, per rank,
``9 h``: the other half into shared memory (``h`` read, ``h`` written), the
sum of its own half (``2 h`` read, ``h`` written), its sum into shared memory
and the peer's sum out (``2 h`` read, ``2 h`` written).
``benchmarks/collectives.py`` prints the floor ``4.5 h / C`` (C: this
machine's one-thread copy rate) beside the measured time; vectors read in
place need ``5 h``: ``2.5 h / C``. The all-gather from the owner's memory
moves ``2 h`` instead of ``4 h`` (in the kernel, about 1.6 times a copy's
time per byte here). Profiled on the 2-core machine (16M fp32, per rank and
call pair): CPU time is within 10% of the floor when the ranks run one at a
time; when both run at once each copy slows by about a quarter (the cores
share the memory), and the rest of the wall time is waiting for a core
that other work holds.

Linux only (``memfd_create``, ``pidfd_open``, ``futex``), x86-64 or aarch64.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from gradhub import codecs
from gradhub._shm import cma, native
from gradhub._shm.memory import forgetting_views, supported
from gradhub.errors import ClosedError, CollectiveTimeoutError, StateError, WorkerFailedError
from gradhub.transports.base import Chunking, Ranges, Transport
from gradhub.transports.group import CollectiveGroup, Operation
from gradhub.transports.schedule import reduction_order
from gradhub.transports.shm_control import (
    ADDRESS,
    ENTERED,
    FLAG,
    Control,
    control_bytes,
)
from gradhub.transports.shm_regions import Regions
from gradhub.transports.shm_setup import Joined, SharedVectors, died_error, join
from gradhub.transports.shm_sums import add_everywhere, add_values

_log = logging.getLogger("gradhub.collective")

ONE_SYNC_BYTES = 1 << 20
ONE_SYNC_BF16_BYTES = 2 << 20
PAIR_ONE_SYNC_BYTES = 64 << 10
CROSS_READ_BYTES = 4 << 20

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
        super().__init__(group.rank, group.world_size)
        self.group = group
        self.ranks = list(ranks)
        self.size = len(self.ranks)
        self.index = self.ranks.index(group.rank)
        self._sequence = 0
        self._joined = Joined()
        self._regions: Regions | None = None
        self._control: Control | None = None
        self._closed = False
        self._op = op
        self._shared = SharedVectors()
        try:
            size = control_bytes(self.size)
            self._joined = join(
                group, self.ranks, op, key, size, self._died_now, self._setup_timeout
            )
            control = self._joined.control
            assert control is not None
            self._regions = Regions(self._joined, self.size, self.index)
            self._control = Control(group, self.ranks, self._joined.pids, control.mm, op)
            self._cross = self._control.cross_reads(op)
        except BaseException:
            self.close()
            raise
        _log.debug(
            "[rank %d] shared memory with ranks %s (pids %s), all-gather %s",
            group.rank,
            self.ranks,
            self._joined.pids,
            "from the owners' memory" if self._cross else "through the regions",
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

    @forgetting_views
    def all_reduce(
        self, op: Operation, flat: torch.Tensor, codec: codecs.Codec, chunking: Chunking
    ) -> None:
        """Plain values in one synchronisation or in two (see the module docstring)."""
        plain = isinstance(codec, codecs.NoCompression)
        size = flat.numel() * flat.element_size()
        pair = self.size == 2 and flat.dtype in native.PAIR_DTYPES and flat.is_contiguous()
        pair = plain and pair  # every rank takes the same path, whether its C part is loaded or not
        halves = size < 2 * CROSS_READ_BYTES or not self._cross  # else one copy fewer, below
        if pair and halves and size > PAIR_ONE_SYNC_BYTES:
            k, first = self._begin(op, flat.numel(), flat.dtype)
            second = self._begin(op, flat.numel(), flat.dtype)[1]
            return self._ctl.all_reduce_halves(op, k, flat, first, second)
        limit = ONE_SYNC_BF16_BYTES if flat.dtype == torch.bfloat16 else ONE_SYNC_BYTES
        if not plain or size * (self.size - 1) > limit:
            return super().all_reduce(op, flat, codec, chunking)
        k, regions = self._begin(op, flat.numel(), flat.dtype)
        if pair and native.loaded():
            self._ctl.all_reduce_pair(op, k, flat, regions)
        else:
            regions[self.index].copy_(flat)
            self._publish(op, k, "all_reduce")
            add_everywhere(regions, flat, self.group)
        del regions

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
        self._ctl.set(FLAG + k % 2, vector)
        return vector != 0

    def _sources(self, k: int, regions: list[torch.Tensor]) -> list[torch.Tensor]:
        """Where each rank's values of operation ``k`` lie: its vector or its region."""
        flags = [self._ctl.get(FLAG + k % 2, j) for j in range(self.size)]
        return [self._shared.vector(f, j) if f else regions[j] for j, f in enumerate(flags)]

    def _finish(self, op: Operation, k: int, during: str, exposed: bool) -> None:
        """Say this rank is done reading operation ``k``; if ``exposed`` (the others
        read this rank's own memory), wait until every rank is."""
        self._ctl.finish(op, k, during, exposed)

    @forgetting_views
    def broadcast(self, op: Operation, tensor: torch.Tensor, root: int) -> None:
        raw = tensor.view(-1).view(torch.uint8)
        k, regions = self._begin(op, raw.numel(), torch.uint8)
        source = self.ranks.index(root)
        if self.index == source:
            regions[source].copy_(raw)
        self._publish(op, k, "broadcast")
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
        like the ring's point-to-point path (see the module docstring). With
        ``"none"`` the values may be bf16 or fp16 (:mod:`.shm_sums`).
        """
        P, me = self.size, self.index
        plain = isinstance(codec, codecs.NoCompression)
        prescale = hop and codec.wire_dtype == torch.float16
        dtype = flat.dtype if plain else torch.float32 if hop else codec.wire_dtype
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
        self._publish(op, k, "reduce_scatter")
        sources = self._sources(k, regions)
        order = reduction_order(me, P)  # this rank last
        at = 0
        for s, n in owned[me]:
            parts = [sources[j][s : s + n] for j in order[:-1]]
            add_values(parts, flat[s : s + n], codec, out[at : at + n], hop=hop, group=self.group)
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
        holds this rank's, back to back. With ``"none"``: any dtype, as it is.
        """
        me = self.index
        plain = isinstance(codec, codecs.NoCompression)
        k, regions = self._begin(op, out.numel(), out.dtype if plain else codec.wire_dtype)
        exposed = self._expose(k, out, plain)
        # the others read this rank's slice where it lies (one copy, not two)
        direct = (
            self._cross
            and plain
            and not exposed
            and own_wire.is_contiguous()
            and own_wire.numel() * own_wire.element_size() >= CROSS_READ_BYTES
        )
        self._ctl.set(ADDRESS + k % 2, own_wire.data_ptr() if direct else 0)
        at = 0
        for s, n in owned[me] if not direct else ():  # into the region, or the exposed vector
            into = out[s : s + n] if exposed else regions[me][s : s + n]
            if into.data_ptr() != own_wire[at:].data_ptr():
                into.copy_(own_wire[at : at + n])
            at += n
        self._ctl.publish(ENTERED, k)
        at = 0
        for s, n in owned[me] if not exposed else ():
            wire, own_out = own_wire[at : at + n], out[s : s + n]
            at += n
            if n and not (plain and wire.data_ptr() == own_out.data_ptr()):
                own_out.copy_(wire if plain else codec.decode(wire))
        self._ctl.wait_all(op, k, ENTERED, k, "all_gather")
        sources = self._sources(k, regions)
        for c, segments in enumerate(owned):
            address, at = self._ctl.get(ADDRESS + k % 2, c), 0
            for s, n in segments if c != me else ():
                if address and n:
                    self._read(op, c, address + at * out.element_size(), out[s : s + n])
                elif n:
                    part = sources[c][s : s + n]
                    out[s : s + n].copy_(part if plain else codec.decode(part))
                at += n
        del regions, sources
        self._finish(op, k, "all_gather", exposed or direct)

    def _read(self, op: Operation, c: int, address: int, into: torch.Tensor) -> None:
        """Copy rank ``c``'s values at ``address`` in its memory into ``into``."""
        try:
            cma.read_into(self._joined.pids[c], address, into)
        except OSError as exc:
            # ESRCH: the process is gone (its pidfd may not say so yet while it exits).
            if isinstance(exc, ProcessLookupError) or not self._ctl.alive(c):
                raise self._died(op, c, "all_gather") from exc
            self.group.mark_broken(f"{op.name} failed")
            raise StateError(
                f"[rank {self.group.rank}] {op.name}: reading rank {self.ranks[c]}'s slice "
                f"in its memory failed ({exc}). The group is unusable: restart the job"
            ) from exc

    # -------------------------------------------------------- synchronisation
    def _begin(
        self, op: Operation, numel: int, dtype: torch.dtype
    ) -> tuple[int, list[torch.Tensor]]:
        """Number the operation, grow the data segment if needed, and return
        the regions of this operation's set as ``numel``-element views."""
        k = self._next(op)
        assert self._regions is not None  # _next refuses a closed transport
        return k, self._regions.of(op, k, numel, dtype, self._died_now, self._late)

    def _next(self, op: Operation, *, count: bool = True) -> int:
        """The number of operation ``op`` (refused once closed)."""
        if self._closed:
            raise ClosedError(
                f"[rank {self.group.rank}] {op.name}: the shared-memory transport is closed"
            )
        self._op = op
        self._sequence += count
        return self._sequence

    @property
    def _ctl(self) -> Control:
        if self._control is None:
            raise ClosedError(f"[rank {self.group.rank}] the shared-memory transport is closed")
        return self._control

    def _publish(self, op: Operation, k: int, during: str) -> None:
        """Say this rank's data of operation ``k`` are there; wait for every rank's."""
        self._ctl.publish(ENTERED, k)
        self._ctl.wait_all(op, k, ENTERED, k, during)

    # ---------------------------------------------------------------- errors
    def _late(self, j: int) -> CollectiveTimeoutError:
        return self._ctl.late(self._op, self._sequence, j)

    def _died_now(self, j: int, during: str) -> WorkerFailedError | CollectiveTimeoutError:
        return self._died(self._op, j, during)

    def _died(
        self, op: Operation, j: int, during: str
    ) -> WorkerFailedError | CollectiveTimeoutError:
        if self._control is not None:
            return self._control.died(op, j, during)
        pids = self._joined.pids
        return died_error(self.group, op, self.ranks[j], pids[j] if j < len(pids) else None, during)

    def _setup_timeout(self, missing: list[int]) -> CollectiveTimeoutError:
        return self.group.timed_out(self._op, missing[0] if len(missing) == 1 else None)

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Unmap the segments, close sockets and pidfds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._control is not None:
            self._control.close()  # releases the control mapping's buffer and the pidfds
        self._shared.close()
        if self._regions is not None:
            self._regions.close()
        if self._joined.control is not None:
            self._joined.control.close()
        self._joined.control = None
        self._joined.close()
