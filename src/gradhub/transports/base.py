"""The transport interface: what every way of moving a collective's bytes promises.

A :class:`Transport` belongs to one :class:`~.group.CollectiveGroup`, which
holds it (:attr:`~.group.CollectiveGroup.transport_choice`,
:attr:`~.group.CollectiveGroup.device_transport`): it is made by
:func:`.choice.select`, the one place that picks it, and closed with the
group. The interface itself knows only the rank and the group's size (an
implementation keeps its group), so the group can name this class without
an import circle. Callers (:mod:`gradhub.collective.collectives`, hence
``AllReduceParameter``, the strategies and the torch.distributed backend)
reach it only through these methods, on the group's worker thread, inside an
:class:`~.operation.Operation` begun with :func:`.choice.begin` (which
checks in through the store unless ``transport.checks_in`` is false).

Contract, for every implementation:

- **Collective.** Every rank of the group calls the same methods in the same
  order with the same sizes, ``ranges``, codec and :class:`Chunking`.
- **Vectors.** ``flat`` and ``out`` are flat contiguous fp32 tensors on the
  group's device; wire tensors are in ``codec.wire_dtype``. ``ranges`` gives
  every rank's ``(start, length)`` in rank order, back to back, covering the
  vector (empty ones allowed). ``out`` may alias this rank's own slice of
  ``flat`` (reduce-scatter) or hold ``own_wire`` at its own place (all-gather).
- **Summation order.** The fp32 sum of a chunk is the same on every rank and
  every run. When :attr:`Transport.ring_order` is true it is the ring's:
  the other ranks' values folded in :func:`.schedule.reduction_order` of
  the chunk's owner, the owner's own values added last, with a lossy codec
  rounding as the ring rounds (once per hop on its point-to-point path, once
  per contribution when the vector is at most ``chunking.small_bytes`` on the
  wire): transports with ``ring_order`` give one another's bits. Otherwise the
  transport's docstring states its order and a test checks it bit for bit.
  After an all-gather every rank holds the same bits (the owner's wire values
  decoded).
- **Failures.** Every wait ends by the operation's deadline. A peer that is
  alive but late is a :class:`~gradhub.errors.CollectiveTimeoutError` whose
  ``missing_ranks`` names the ranks that did not enter the operation (else
  the one waited on); a peer that died is a
  :class:`~gradhub.errors.WorkerFailedError` whose message says
  ``rank N`` (group rank) and what it died during. Either breaks the group
  (:meth:`CollectiveGroup.mark_broken`); c10d errors are translated by
  :meth:`CollectiveGroup.failure`, never raised raw.
- **Lifecycle.** :meth:`close` releases what the transport holds
  (idempotent); the group calls it when it closes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from gradhub import codecs
from gradhub.partition import partition_ranges
from gradhub.transports.operation import Operation

DEFAULT_PIPELINE_ELEMENTS = 1 << 21
"""Elements per point-to-point message (8 MiB of fp32). Large enough that
per-message costs vanish, small enough that adding overlaps the transfer; see
``benchmarks/collectives.py``. Every rank must use the same value."""

SMALL_BYTES = 4 << 20
"""Vectors of at most this many wire bytes use the backend's own collectives
(``all_to_all_single`` + ``all_gather_single``) on the ring too: gloo's
point-to-point messages cost ~3 ms each way back to back on the 2-core
benchmark machine, where its collectives cost well under 1 ms; from about 4M
fp32 elements on, the ring's halved bytes win. See ``benchmarks/collectives.py``.
Every rank must use the same value."""

Ranges = Sequence[tuple[int, int]]
"""Every rank's ``(start, length)`` in a flat vector, in rank order."""


@dataclass(frozen=True, kw_only=True)
class Chunking:
    """How an operation cuts its vector (the same on every rank)."""

    pipeline_elements: int = DEFAULT_PIPELINE_ELEMENTS
    """Elements per point-to-point message."""
    small_bytes: int = SMALL_BYTES
    """Vectors of at most this many wire bytes take the collective path (and
    its rounding: once per contribution for a lossy codec)."""

    def small(self, numel: int, codec: codecs.Codec) -> bool:
        """Whether ``numel`` elements in ``codec`` take the collective path."""
        return numel * codec.bytes_per_element <= self.small_bytes


class Transport(ABC):
    """One way of moving a group's collectives (see the module docstring)."""

    name: ClassVar[str]
    """The name :mod:`.choice` knows it by (``GRADHUB_TRANSPORT``, ``transport=``)."""
    checks_in: ClassVar[bool] = True
    """Whether operations check in through the store; ``False`` for a transport
    that tells by itself which ranks entered an operation."""
    ring_order: ClassVar[bool] = True
    """Whether sums are the ring's bits (see the module docstring)."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        """This process's rank in the group."""
        self.world_size = world_size
        """The number of ranks of the group."""

    @abstractmethod
    def reduce_scatter(
        self,
        op: Operation,
        flat: torch.Tensor,
        codec: codecs.Codec,
        ranges: Ranges,
        out: torch.Tensor,
        chunking: Chunking,
    ) -> None:
        """``out`` = the sum over the ranks of this rank's slice ``ranges[rank]``
        of ``flat`` (fp32); ``flat`` is not modified outside ``out``."""

    @abstractmethod
    def all_gather(
        self,
        op: Operation,
        own_wire: torch.Tensor,
        codec: codecs.Codec,
        ranges: Ranges,
        out: torch.Tensor,
        chunking: Chunking,
    ) -> None:
        """Every rank's slice, given encoded (this rank's is ``own_wire``),
        decoded into its place ``ranges[r]`` of ``out``."""

    def all_reduce(
        self, op: Operation, flat: torch.Tensor, codec: codecs.Codec, chunking: Chunking
    ) -> None:
        """``flat`` = its sum over the ranks, in place: a reduce-scatter into this
        rank's own slice, then an all-gather over ``flat`` (the same bits as the
        two calls), within ``op``'s one deadline."""
        ranges = partition_ranges(flat.numel(), self.world_size)
        start, length = ranges[self.rank]
        own = flat[start : start + length]
        self.reduce_scatter(op, flat, codec, ranges, own, chunking)
        wire = own if isinstance(codec, codecs.NoCompression) else codec.encode(own)
        self.all_gather(op, wire, codec, ranges, flat, chunking)

    def shared_vector(self, op: Operation, numel: int) -> torch.Tensor | None:
        """A new fp32 vector of ``numel`` elements that the other ranks read in
        place when it is the whole ``flat`` of a reduce-scatter or ``out`` of an
        all-gather (collective, within ``op``), or ``None``: this transport has
        no such vectors (the default)."""
        return None

    @abstractmethod
    def broadcast(self, op: Operation, tensor: torch.Tensor, root: int) -> None:
        """``tensor`` (contiguous, any dtype, the same shape on every rank) =
        rank ``root``'s, bit for bit, in place."""

    def close(self) -> None:  # noqa: B027 (a transport holding nothing has nothing to do)
        """Release what the transport holds. Idempotent."""
