"""Hierarchical reduce-scatter and all-gather, for jobs whose hosts hold several ranks.

A flat ring across hosts carries every chunk over each host boundary it
meets on its way round; here each host sends its bytes over the network once
(:mod:`.choice` picks this path by itself when the ranks span hosts and
every host holds the same number, at least 2, of them).

With ``H`` hosts of ``L`` ranks, hosts ordered by their lowest rank and the
ranks of a host ascending, *column* ``i`` is the ``i``-th rank of every host
(``H`` ranks, one per host). Rank ``r`` still ends with its own slice
``ranges[r]`` of the usual partition (:func:`gradhub.partition.partition_ranges`
over all ``P = H * L`` ranks), whichever host it is on.

Reduce-scatter:

1. Inside each host, over shared memory (:class:`.shm.ShmTransport`): the
   ``i``-th rank of the host sums, in fp32, the host's values of the slices of
   column ``i``'s ranks, back to back in column order (``N / L`` elements).
2. Between hosts, one ring per column (:mod:`.p2p_ring`) reduce-scatters those
   host sums, so each rank ends with the sum of its own slice over every
   host. Only this step uses the network: per host ``(H - 1) / H`` of the
   vector, a flat ring's ``(P - 1) / P`` on each host boundary it crosses.

All-gather: the same two steps backwards, wire bytes forwarded unchanged (the
ring of each column, then shared memory inside each host); every rank decodes
the owner's wire values, so every rank ends with the same bits.

Bytes each host sends per all-reduce (reduce-scatter + all-gather) of ``N``
bytes: ``2 (H - 1) / H * N``, the least any all-reduce between ``H`` hosts
can send; a flat ring over hosts holding consecutive ranks sends
``2 (P - 1) / P * N`` (at 2 hosts x 2 ranks: ``N`` against ``1.5 N``, 2/3),
and over hosts holding interleaved ranks every link crosses hosts (``L``
times that).

Summation order (decided; stated in the README): chunk of the rank at host
``h``, position ``i``: ``S_h' = fold over j in reduction_order(i, L) of the
values of host h's j-th rank``, then ``fold over h' in reduction_order(h, H)
of S_h'``, with :func:`.schedule.reduction_order` as on the ring. At 2 hosts
x 2 ranks that is ``(g0 + g1) + (g2 + g3)`` for every chunk, where the flat
ring and the one-host shared memory compute ``((g_a + g_b) + g_c) + g_d`` in
a rotating order. A flat ring cannot add in host groups without sending
more, and changing every transport's order to a tree would break the
ring's bandwidth, so the hierarchical result is *not* bit-identical to the
flat ring or to one host with as many ranks: fp32 sums differ in the last
bits (relative ~1e-7 of the sum's magnitude per addition). It is fixed run to
run and identical on every rank. ``GRADHUB_TRANSPORT=ring`` (or
``transport="ring"``) keeps the flat ring and its bits.

Failures: every wait is bounded by the operation's deadline, as on the ring
and in shared memory. A rank that dies is named by the ranks of its host
(shared memory watches its process) and by the ranks of other hosts (the
ring's roll call: the dead rank's host mates answer it before they leave).

Codecs: the host sums are fp32 (no wire inside a host); the codec applies to
the ring between hosts only, rounding the partial sum once per hop as the
ring does (``H - 1`` roundings instead of ``P - 1``); ``"fp16"`` divides the
host sums by ``P`` before and multiplies by ``P`` after, as the ring does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from gradhub import codecs
from gradhub._shm.hosts import HostLayout
from gradhub.errors import InvalidOptionError, WorkerFailedError
from gradhub.transports.base import Chunking, Ranges, Transport
from gradhub.transports.group import CollectiveGroup, Operation
from gradhub.transports.native import backend_broadcast
from gradhub.transports.p2p_ring import ring_all_gather, ring_reduce_scatter
from gradhub.transports.shm import ShmTransport

_PLAIN = codecs.NoCompression()


def fits(layout: HostLayout) -> bool:
    """Whether ``layout`` has several hosts, each with the same number (>= 2) of ranks."""
    sizes = {len(h) for h in layout.hosts}
    return len(layout.hosts) > 1 and len(sizes) == 1 and min(sizes) > 1


class HierarchicalTransport(Transport):
    """Shared memory inside this host plus one ring per column between hosts.

    Set up collectively (every rank of the group constructs it at the same
    operation); :meth:`close` releases the shared memory (idempotent).
    Broadcast is the backend's own (no sum, so no order to keep).
    """

    name = "hierarchical"
    ring_order = False  # each host's values first: see the module docstring

    def __init__(self, group: CollectiveGroup, layout: HostLayout, op: Operation, key: str):
        if not fits(layout):
            raise InvalidOptionError(
                f"[rank {group.rank}] the hierarchical transport needs several hosts with "
                f"the same number (>= 2) of ranks each; got {[list(h) for h in layout.hosts]}"
            )
        super().__init__(group.rank, group.world_size)
        self.group = group
        local = layout.local_ranks
        self.index = local.index(group.rank)
        self.columns = [[host[i] for host in layout.hosts] for i in range(len(local))]
        """``columns[i]``: the ``i``-th rank of every host, in host order."""
        self.column = self.columns[self.index]
        self.local = ShmTransport(group, local, op, f"{key}/{local[0]}")

    def _column_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """This column's slices back to back: ``(start, length)`` in the column vector."""
        out, at = [], 0
        for r in self.column:
            out.append((at, ranges[r][1]))
            at += ranges[r][1]
        return out

    def _owned(self, ranges: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        return [[ranges[r] for r in column] for column in self.columns]

    def reduce_scatter(
        self,
        op: Operation,
        flat: torch.Tensor,
        codec: codecs.Codec,
        ranges: Ranges,
        out: torch.Tensor,
        chunking: Chunking,
    ) -> None:
        """Sum ``flat`` over every rank; this rank's slice ``ranges[rank]`` into ``out``."""
        columns = self._column_ranges(ranges)
        total = sum(n for _, n in columns)
        host_sums = self.group.scratch("hierarchical_sums", total, torch.float32)
        with self._survivor(op):
            self.local.reduce_scatter_segments(
                op, flat, _PLAIN, self._owned(ranges), host_sums, hop=False
            )
        prescale = codec.wire_dtype == torch.float16
        if prescale:
            host_sums.div_(self.group.world_size)
        pipeline = chunking.pipeline_elements
        ring_reduce_scatter(
            self.group, op, host_sums, codec, columns, pipeline, out, members=self.column
        )
        if prescale:
            out.mul_(self.group.world_size)

    def all_gather(
        self,
        op: Operation,
        own_wire: torch.Tensor,
        codec: codecs.Codec,
        ranges: Ranges,
        out: torch.Tensor,
        chunking: Chunking,
    ) -> None:
        """Every rank's encoded slice, decoded into its place in ``out`` (flat fp32)."""
        columns = self._column_ranges(ranges)
        total = sum(n for _, n in columns)
        wire = self.group.scratch("hierarchical_wire", total, codec.wire_dtype)
        s, n = columns[self.column.index(self.group.rank)]
        wire[s : s + n].copy_(own_wire)
        pipeline = chunking.pipeline_elements
        ring_all_gather(self.group, op, wire, columns, pipeline, members=self.column)
        with self._survivor(op):
            self.local.all_gather_segments(op, wire, codec, self._owned(ranges), out)

    def broadcast(self, op: Operation, tensor: torch.Tensor, root: int) -> None:
        backend_broadcast(self.group, op, tensor, root)

    @contextlib.contextmanager
    def _survivor(self, op: Operation) -> Iterator[None]:
        """A rank of this host that died: this rank leaves the operation alive
        and says so in the roll call, so its peers on other hosts (whose ring
        then loses this rank) name the dead rank, not this one."""
        try:
            yield
        except WorkerFailedError:
            self.group.answer_roll_call(op)
            raise

    def close(self) -> None:
        """Release the shared memory. Idempotent."""
        self.local.close()
