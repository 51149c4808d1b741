"""The bandwidth-optimal ring over gloo point-to-point messages (transport ``"ring"``).

Each rank sends (P-1)/P of the bytes to its right-hand neighbour in pipelined
chunks; the chunk schedule and the fixed summation order come from
:mod:`gradhub.transports.schedule`, so every rank's result is bit-identical
run to run. gloo's own reduce-scatter is built from one all-reduce per rank,
which is why it is not used.

- Every receive of an operation is posted before the first send, so no
  message waits for its receiver to get ready.
- Chunks are cut into messages of at most ``pipeline_elements`` elements: a
  rank adds (or forwards) one message while the next one is on the wire.
- Wire data is in the codec's type. Each hop decodes, adds its own fp32 values
  in fp32, and encodes the partial sum once for the next hop; the owner adds
  its values last and keeps the fp32 sum. With ``"fp16"`` every contribution
  is divided by ``P`` before it is encoded, so partial sums stay within the
  half range, and the result is multiplied back by ``P``. With a lossy codec,
  the error of the sum is at most ``(P - 1) * relative_error * sum(|x_i|)``
  (one rounding per hop).
- The all-gather forwards wire bytes unchanged, and every rank, the owner
  included, decodes the same bytes: all ranks end with the same bits.

Small vectors (at most ``chunking.small_bytes`` on the wire) on gloo, and
every vector on NCCL, take the backend's collectives instead
(:mod:`.native`): for ``"none"`` the same bits (NCCL's native reduce-scatter
aside), for lossy codecs one rounding per contribution instead of one per
hop. gloo's point-to-point messages have a high fixed cost
(:data:`.base.SMALL_BYTES`), its collectives do not.

``members``: the group ranks that form the ring, in ring order (default:
every rank, ascending); chunk ``c`` of ``ranges`` is the slice of
``members[c]``. :mod:`gradhub.transports.hierarchical` runs one ring per
column of ranks across hosts this way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from gradhub import codecs
from gradhub.transports.base import Chunking, Ranges, Transport
from gradhub.transports.group import CollectiveGroup, Operation
from gradhub.transports.native import (
    backend_broadcast,
    collective_all_gather,
    exchange_reduce_scatter,
    native_reduce_scatter,
)
from gradhub.transports.schedule import (
    all_gather_recv_chunk,
    message_tag,
    reduce_scatter_recv_chunk,
    reduce_scatter_send_chunk,
    sub_ranges,
)


class _Ring:
    """This rank's place in a ring of ``members`` (group ranks, in ring order)."""

    def __init__(self, group: CollectiveGroup, members: Sequence[int] | None):
        self.members = list(range(group.world_size)) if members is None else list(members)
        self.size = len(self.members)
        self.position = self.members.index(group.rank)
        self.right = self.members[(self.position + 1) % self.size]
        self.left = self.members[(self.position - 1) % self.size]


class _Sender:
    """Numbers this operation's messages to the right-hand neighbour and keeps
    each buffer alive until its send is done."""

    def __init__(self, group: CollectiveGroup, op: Operation, peer: int):
        self.group, self.op = group, op
        self.peer = peer
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []
        self.count = 0
        self.first = op.messages

    def send(self, buffer: torch.Tensor) -> None:
        tag = message_tag(self.op.sequence, self.first + self.count)
        self.count += 1
        try:
            work = dist.isend(buffer, self.peer, group=self.group.process_group, tag=tag)
        except RuntimeError as exc:  # gloo refuses to post on a connection already closed
            raise self.group.failure(self.op, self.peer, exc) from exc
        assert work is not None
        self.pending.append((work, buffer))

    def finish(self, received: int) -> None:
        """Wait for every send; the operation's next step tags after this one's
        ``received`` receives and this one's sends."""
        for work, _ in self.pending:
            self.group.wait(self.op, work, self.peer)
        self.pending.clear()
        self.op.messages = self.first + max(self.count, received)


def _post_receives(
    group: CollectiveGroup,
    op: Operation,
    peer: int,
    buffer: torch.Tensor,
    chunks: list[int],
    ranges: Sequence[tuple[int, int]],
    pipeline: int,
) -> list[tuple[int, int, int, dist.Work]]:
    """Post one receive from ``peer`` per message of ``chunks`` (in order) into
    ``buffer``; returns ``(step, start, length, work)`` in the order they will arrive."""
    posted: list[tuple[int, int, int, dist.Work]] = []
    for step, chunk in enumerate(chunks):
        for s, n in sub_ranges(*ranges[chunk], pipeline):
            tag = message_tag(op.sequence, op.messages + len(posted))
            try:
                work = dist.irecv(buffer[s : s + n], peer, group=group.process_group, tag=tag)
            except RuntimeError as exc:  # a connection already closed: the peer is gone
                raise group.failure(op, peer, exc) from exc
            assert work is not None
            posted.append((step, s, n, work))
    return posted


def ring_reduce_scatter(
    group: CollectiveGroup,
    op: Operation,
    x: torch.Tensor,
    codec: codecs.Codec,
    ranges: Sequence[tuple[int, int]],
    pipeline: int,
    out: torch.Tensor,
    members: Sequence[int] | None = None,
) -> None:
    ring = _Ring(group, members)
    P, r = ring.size, ring.position
    own_start = ranges[r][0]
    plain = isinstance(codec, codecs.NoCompression)
    # Each chunk reaches this rank at most once, so one buffer holds every message.
    inbox = group.scratch("reduce_scatter", x.numel(), codec.wire_dtype)
    chunks = [reduce_scatter_recv_chunk(r, s, P) for s in range(P - 1)]
    receives = _post_receives(group, op, ring.left, inbox, chunks, ranges, pipeline)
    sender = _Sender(group, op, ring.right)
    for s, n in sub_ranges(*ranges[reduce_scatter_send_chunk(r, 0, P)], pipeline):
        sender.send(x[s : s + n] if plain else codec.encode(x[s : s + n]))
    for step, s, n, work in receives:
        group.wait(op, work, ring.left)
        received, mine = inbox[s : s + n], x[s : s + n]
        last = step == P - 2
        if plain:  # fp32 on the wire: add in place and forward the same buffer
            if last:
                torch.add(received, mine, out=out[s - own_start : s - own_start + n])
            else:
                sender.send(received.add_(mine))
        else:
            partial = codec.decode(received).add_(mine)
            if last:
                out[s - own_start : s - own_start + n].copy_(partial)
            else:
                sender.send(codec.encode(partial))
    sender.finish(len(receives))


def ring_all_gather(
    group: CollectiveGroup,
    op: Operation,
    wire: torch.Tensor,
    ranges: Sequence[tuple[int, int]],
    pipeline: int,
    members: Sequence[int] | None = None,
) -> None:
    ring = _Ring(group, members)
    P, r = ring.size, ring.position
    chunks = [all_gather_recv_chunk(r, s, P) for s in range(P - 1)]
    receives = _post_receives(group, op, ring.left, wire, chunks, ranges, pipeline)
    sender = _Sender(group, op, ring.right)
    for s, n in sub_ranges(*ranges[r], pipeline):
        sender.send(wire[s : s + n])
    for step, s, n, work in receives:
        group.wait(op, work, ring.left)
        if step < P - 2:
            sender.send(wire[s : s + n])
    sender.finish(len(receives))


class RingTransport(Transport):
    """The point-to-point ring over the group's process group (every backend)."""

    name = "ring"

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
        group, plain = self.group, isinstance(codec, codecs.NoCompression)
        nccl = group.backend_of(flat.device) == "nccl"
        if nccl and plain:
            native_reduce_scatter(group, op, flat, ranges, out)
            return
        if nccl or chunking.small(flat.numel(), codec):
            exchange_reduce_scatter(group, op, flat, codec, ranges, out)
            return
        prescale = codec.wire_dtype == torch.float16
        x = flat
        if prescale:
            x = torch.div(
                flat, group.world_size, out=group.scratch("prescale", flat.numel(), flat.dtype)
            )
        ring_reduce_scatter(group, op, x, codec, ranges, chunking.pipeline_elements, out)
        if prescale:
            out.mul_(group.world_size)

    def all_gather(
        self,
        op: Operation,
        own_wire: torch.Tensor,
        codec: codecs.Codec,
        ranges: Ranges,
        out: torch.Tensor,
        chunking: Chunking,
    ) -> None:
        group, size = self.group, out.numel()
        if group.backend_of(out.device) == "nccl" or chunking.small(size, codec):
            collective_all_gather(group, op, own_wire, out, codec, ranges)
            return
        start, length = ranges[group.rank]
        direct = codec.wire_dtype == torch.float32
        wire = out if direct else group.scratch("all_gather", size, codec.wire_dtype)
        wire[start : start + length].copy_(own_wire)
        ring_all_gather(group, op, wire, ranges, chunking.pipeline_elements)
        if not direct:
            out.copy_(codec.decode(wire))

    def broadcast(self, op: Operation, tensor: torch.Tensor, root: int) -> None:
        backend_broadcast(self.group, op, tensor, root)
