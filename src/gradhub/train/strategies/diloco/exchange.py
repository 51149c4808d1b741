"""One sync's exchange: the weighted pseudo-gradients summed over the workers.

``compress="none"``: one fp32 all-reduce of the (fragment's) flat
pseudo-gradient on the job's group's transport
(:func:`gradhub.collective.all_reduce`); a ring sends about
``2 (P - 1) / P * 4 n`` bytes per rank for ``n`` values over ``P`` ranks.

A codec: each rank encodes its weighted pseudo-gradient once
(:meth:`gradhub.codecs.Codec.encode`), the encoded bytes are all-gathered as
they are (every rank sends ``(P - 1) * w`` bytes on a ring, ``w`` the wire
length: ``2 n`` for ``bf16``, ``0.625 n`` plus a 16-byte header for ``fp4``),
and every rank decodes them and adds them in rank order in fp32: the same
operations on the same bits, so the same sum on every rank. An all-reduce
of the codec's wire would round every partial sum to it on the way; the
gather sums in fp32 only. No error feedback: each sync's rounding is lost
(the streaming DiLoCo paper's 4-bit pseudo-gradients keep none either, and
the outer momentum averages it over the syncs).

Behind every exchange, a 4-float fp32 all-reduce (:class:`Tally`: the
weight, the backward-count check, and whether a rank saw a newer membership
of a surviving job; host data where the group carries host memory). Both
run on the group's worker thread: :func:`start` returns at once and
:meth:`Exchange.wait` gives the result, so inner steps may run between.
"""

from __future__ import annotations

import torch

from gradhub import codecs
from gradhub.collective import CollectiveFuture, CollectiveGroup, all_reduce
from gradhub.collective.collectives import run_all_gather
from gradhub.train.strategies.diloco.servers import ServerSync

_PLAIN = codecs.NoCompression()

TALLY = 4
"""Values of a tally: the rank's weight, its backward count (mod 64) and its
square, and 1 where it saw a newer membership of a surviving job."""


class Tally:
    """The 4 floats summed behind each exchange, in a tensor on the group's
    device; written and read through a NumPy view where that is host memory
    (no host synchronisation)."""

    def __init__(self, device: torch.device) -> None:
        self.tensor = torch.zeros(TALLY, dtype=torch.float32, device=device)
        self._host = self.tensor.numpy() if self.tensor.device.type == "cpu" else None

    def write(self, values: list[float]) -> None:
        """Set the values (a saved tally of an older layout is padded with zeros)."""
        full = [*values, *[0.0] * (TALLY - len(values))]
        if self._host is not None:
            self._host[:] = full
        else:
            self.tensor.copy_(torch.tensor(full), non_blocking=True)

    def read(self) -> list[float]:
        host = self._host if self._host is not None else self.tensor.cpu().numpy()
        return [float(v) for v in host]


class Exchange:
    """An exchange in flight: :meth:`wait` returns the summed flat pseudo-gradient
    (the tensor given to :func:`start`, overwritten) and the summed tally."""

    def __init__(
        self,
        flat: torch.Tensor,
        tally: torch.Tensor,
        waits: list[CollectiveFuture[torch.Tensor]],
    ) -> None:
        self.flat, self.tally = flat, tally
        self._waits = waits

    def wait(self) -> tuple[torch.Tensor, torch.Tensor]:
        for future in self._waits:
            future.wait()
        self._waits = []
        return self.flat, self.tally


class Pending:
    """A fragment's exchange in flight (or the servers' sync), merged after
    ``remaining`` more inner steps; ``start``: where the local progress of those
    steps starts (with ``overlap``)."""

    def __init__(
        self,
        fragment: int,
        job: Exchange | ServerSync,
        start: list[torch.Tensor] | None,
        tau: int,
    ) -> None:
        self.fragment, self.job, self.start, self.remaining = fragment, job, start, tau


def start(
    flat: torch.Tensor, tally: torch.Tensor, codec: codecs.Codec, group: CollectiveGroup
) -> Exchange:
    """Start summing ``flat`` (contiguous fp32) and ``tally`` over ``group``'s ranks;
    touch neither until :meth:`Exchange.wait` returns."""
    if isinstance(codec, codecs.NoCompression):
        summed = all_reduce(flat, group=group)
    else:
        wire = codec.encode(flat)
        summed = group.submit("all_gather", lambda: _gather_and_sum(group, wire, codec, flat))
    return Exchange(flat, tally, [all_reduce(tally, group=group), summed])


def _gather_and_sum(
    group: CollectiveGroup, wire: torch.Tensor, codec: codecs.Codec, out: torch.Tensor
) -> torch.Tensor:
    """On the worker thread: every rank's ``wire`` gathered as raw bytes (carried in
    fp32 slots, copied, never added), decoded and summed into ``out`` in rank order."""
    raw = wire.contiguous().reshape(-1).view(torch.uint8)
    length = -(-raw.numel() // 4)  # fp32 slots per rank
    own = torch.zeros(length * 4, dtype=torch.uint8, device=raw.device)
    own[: raw.numel()] = raw
    world = group.world_size
    ranges = [(r * length, length) for r in range(world)]
    gathered = run_all_gather(group, own.view(torch.float32), world * length, _PLAIN, ranges=ranges)
    slots = gathered.view(torch.uint8).view(world, length * 4)[:, : raw.numel()]
    for r in range(world):
        value = codec.decode(slots[r].contiguous().view(wire.dtype).view(wire.shape))
        if r == 0:
            out.copy_(value.view(-1))
        else:
            out.add_(value.view(-1))
    return out


__all__ = ["TALLY", "Exchange", "Pending", "Tally", "start"]
