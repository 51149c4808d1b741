"""The backend's own collectives as a transport (``"gloo"``; NCCL's paths).

Reduce-scatter: one ``all_to_all_single`` of encoded slices (each rank
receives every rank's copy of its own slice: (P-1)/P of the bytes), then an
fp32 sum in :func:`.schedule.reduction_order`: for ``"none"`` the ring's bits
exactly, for a lossy codec one rounding per contribution (the ring's
collective path). NCCL with ``"none"``: its native reduce-scatter
(``reduce_scatter_single``; ``reduce_scatter_tensor`` before torch 2.13),
slices padded to equal length; its summation order is NCCL's (deterministic
for a fixed topology), not the ring's. All-gather: ``all_gather_single`` of
padded slices. All-reduce without compression: the backend's ``all_reduce``
(gloo's summation order, not the ring's). Broadcast: the backend's.

:class:`~.p2p_ring.RingTransport` uses these functions for small vectors,
where gloo's collectives cost far less than its point-to-point messages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradhub import codecs
from gradhub.transports.base import Chunking, Ranges, Transport
from gradhub.transports.group import CollectiveGroup
from gradhub.transports.operation import Operation
from gradhub.transports.schedule import reduction_order

# torch 2.13 renamed the tensor collectives (the old names warn); older torch
# has only the old names.
_reduce_scatter_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class NativeTransport(Transport):
    """The process group's own collectives at every size."""

    name = "gloo"
    ring_order = False  # its all_reduce sums in gloo's order

    def __init__(self, group: CollectiveGroup):
        super().__init__(group.rank, group.world_size)
        self.group = group

    def reduce_scatter(
        self,
        op: Operation,
        flat: torch.Tensor,
        codec: codecs.Codec,
        ranges: Ranges,
        out: torch.Tensor,
        chunking: Chunking,
    ) -> None:
        if self.group.backend_of(flat.device) == "nccl" and isinstance(codec, codecs.NoCompression):
            native_reduce_scatter(self.group, op, flat, ranges, out)
        else:
            exchange_reduce_scatter(self.group, op, flat, codec, ranges, out)

    def all_gather(
        self,
        op: Operation,
        own_wire: torch.Tensor,
        codec: codecs.Codec,
        ranges: Ranges,
        out: torch.Tensor,
        chunking: Chunking,
    ) -> None:
        collective_all_gather(self.group, op, own_wire, out, codec, ranges)

    def all_reduce(
        self, op: Operation, flat: torch.Tensor, codec: codecs.Codec, chunking: Chunking
    ) -> None:
        if not isinstance(codec, codecs.NoCompression):
            super().all_reduce(op, flat, codec, chunking)
            return
        work = dist.all_reduce(flat, group=self.group.process_group, async_op=True)
        self.group.wait(op, work, None)

    def broadcast(self, op: Operation, tensor: torch.Tensor, root: int) -> None:
        backend_broadcast(self.group, op, tensor, root)


def backend_broadcast(
    group: CollectiveGroup, op: Operation, tensor: torch.Tensor, root: int
) -> None:
    """The backend's broadcast of ``tensor`` from group rank ``root``."""
    source = dist.get_global_rank(group.process_group, root)
    work = dist.broadcast(tensor, source, group=group.process_group, async_op=True)
    group.wait(op, work, None if group.rank == root else root)


def _padded(ranges: Ranges) -> int:
    return max(n for _, n in ranges)


def native_reduce_scatter(
    group: CollectiveGroup, op: Operation, x: torch.Tensor, ranges: Ranges, out: torch.Tensor
) -> None:
    """NCCL's own fp32 reduce-scatter (slices padded to equal length)."""
    P, r = group.world_size, group.rank
    width = _padded(ranges)
    send = x
    if any(n != width for _, n in ranges):
        send = group.scratch("rs_padded", P * width, torch.float32, x.device).zero_()
        for c, (s, n) in enumerate(ranges):
            send[c * width : c * width + n].copy_(x[s : s + n])
    result = group.scratch("rs_result", width, torch.float32, x.device)
    work = _reduce_scatter_native(result, send, group=group.process_group, async_op=True)
    group.wait(op, work, None)
    out.copy_(result[: ranges[r][1]])


def exchange_reduce_scatter(
    group: CollectiveGroup,
    op: Operation,
    x: torch.Tensor,
    codec: codecs.Codec,
    ranges: Ranges,
    out: torch.Tensor,
) -> None:
    """Reduce-scatter as one ``all_to_all_single`` of encoded slices, then an
    fp32 sum in :func:`.schedule.reduction_order` (the ring's bits for "none")."""
    P, r = group.world_size, group.rank
    length = ranges[r][1]
    send = x if isinstance(codec, codecs.NoCompression) else codec.encode(x)
    inbox = group.scratch("rs_inbox", P * length, codec.wire_dtype, x.device)
    work = dist.all_to_all_single(
        inbox,
        send,
        output_split_sizes=[length] * P,
        input_split_sizes=[n for _, n in ranges],
        group=group.process_group,
        async_op=True,
    )
    group.wait(op, work, None)
    order = reduction_order(r, P)
    out.copy_(codec.decode(inbox[order[0] * length : (order[0] + 1) * length]))
    for j in order[1:]:
        out.add_(codec.decode(inbox[j * length : (j + 1) * length]))


def collective_all_gather(
    group: CollectiveGroup,
    op: Operation,
    own_wire: torch.Tensor,
    out: torch.Tensor,
    codec: codecs.Codec,
    ranges: Ranges,
) -> None:
    """All-gather with the backend's own collective (slices padded to equal length)."""
    P = group.world_size
    width = _padded(ranges)
    mine = group.scratch("ag_mine", width, codec.wire_dtype, out.device)
    mine[: own_wire.numel()].copy_(own_wire)
    gathered = group.scratch("ag_gathered", P * width, codec.wire_dtype, out.device)
    work = _all_gather_native(gathered, mine, group=group.process_group, async_op=True)
    group.wait(op, work, None)
    flat = out.view(-1)
    for c, (s, n) in enumerate(ranges):
        flat[s : s + n].copy_(codec.decode(gathered[c * width : c * width + n]))
