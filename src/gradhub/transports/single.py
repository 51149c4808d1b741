"""The transport of a group of one rank: nothing travels.

Reduce-scatter copies the rank's own slice; all-gather decodes its own wire
values into place (so a lossy codec rounds as it would with more ranks);
broadcast leaves the tensor as it is. Chosen by :mod:`.choice` whenever the
group has one rank, whatever transport was asked for.
"""

from __future__ import annotations

import torch

from gradhub import codecs
from gradhub.transports.base import Chunking, Ranges, Transport
from gradhub.transports.group import CollectiveGroup
from gradhub.transports.operation import Operation


class SingleRankTransport(Transport):
    """One rank: copies only."""

    name = "single"
    checks_in = False  # nobody else could be missing

    def __init__(self, group: CollectiveGroup):
        super().__init__(group.rank, group.world_size)

    def reduce_scatter(
        self,
        op: Operation,
        flat: torch.Tensor,
        codec: codecs.Codec,
        ranges: Ranges,
        out: torch.Tensor,
        chunking: Chunking,
    ) -> None:
        start, length = ranges[0]
        out.copy_(flat[start : start + length])

    def all_gather(
        self,
        op: Operation,
        own_wire: torch.Tensor,
        codec: codecs.Codec,
        ranges: Ranges,
        out: torch.Tensor,
        chunking: Chunking,
    ) -> None:
        start, length = ranges[0]
        target = out[start : start + length]
        if isinstance(codec, codecs.NoCompression) and own_wire.dtype == target.dtype:
            if own_wire.data_ptr() != target.data_ptr():  # one copy, no decoded temporary
                target.copy_(own_wire)
        else:
            target.copy_(codec.decode(own_wire))

    def broadcast(self, op: Operation, tensor: torch.Tensor, root: int) -> None:
        pass
