"""Reduce-scatter, all-gather and all-reduce on a group's transport.

``reduce_scatter(x)`` leaves rank ``r`` with the sum over ranks of its own
slice of ``x`` (slices per :func:`gradhub.partition.partition_range`, uneven
and empty slices included); ``all_gather(slice, size)`` puts every rank's
slice together again; ``all_reduce(x)`` sums ``x`` in place. Each is bounded
by the group's timeout (or ``timeout=``).

How the bytes travel is the group's transport's business
(:mod:`gradhub.transports`: the gloo ring, shared memory, hierarchical, the
backend's own collectives; chosen once per group by
:mod:`gradhub.transports.choice`); this module only checks the arguments,
begins the operation and hands it to :class:`~gradhub.transports.base.Transport`.
CUDA tensors of a group that carries host memory only (gloo) are staged
through pinned host buffers (:mod:`.staging`); a group that carries CUDA
tensors on NCCL (alone or in ``"cpu:gloo,cuda:nccl"``) takes NCCL's own
collectives for them, and its CPU tensors stay on the CPU.
The summation order and the rounding of lossy codecs are the transport's
contract (:mod:`gradhub.transports.base`): on the ring, shared memory and one
rank, the same bits, fixed run to run and on every rank. The functions
always return the plain sum (``"fp16"``'s scaling is undone).

Operations run one at a time in the order they are called, on the group's
worker thread (:meth:`CollectiveGroup.submit`; ``reduce_scatter`` and
``all_gather``, whose callers wait at once, on the calling thread when
nothing is queued: :meth:`CollectiveGroup.call`), so several callers cannot
interleave differently on different ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradhub import codecs
from gradhub.collective import staging
from gradhub.collective.staging import Staging
from gradhub.errors import ShapeMismatchError
from gradhub.partition import partition_ranges
from gradhub.transports import choice
from gradhub.transports.base import DEFAULT_PIPELINE_ELEMENTS, SMALL_BYTES, Chunking
from gradhub.transports.group import CollectiveFuture, CollectiveGroup

__all__ = [
    "DEFAULT_PIPELINE_ELEMENTS",
    "SMALL_BYTES",
    "Group",
    "all_gather",
    "all_reduce",
    "reduce_scatter",
    "run_all_gather",
    "run_all_reduce",
    "run_reduce_scatter",
    "run_shared_vectors",
]

Group = CollectiveGroup | dist.ProcessGroup | None


# ----------------------------------------------------------------- public API
def reduce_scatter(
    tensor: torch.Tensor,
    *,
    group: Group = None,
    compress: str | codecs.Codec = "none",
    out: torch.Tensor | None = None,
    timeout: float | None = None,
    pipeline_elements: int = DEFAULT_PIPELINE_ELEMENTS,
    small_bytes: int = SMALL_BYTES,
) -> torch.Tensor:
    """Sum ``tensor`` over the ranks and return this rank's slice of the sum (fp32).

    ``tensor`` is read as a flat vector and must have the same number of
    elements on every rank; it is not modified. ``out`` (contiguous fp32 of
    this rank's slice length) is filled when given, else a new tensor is returned.
    ``out`` may be this rank's own slice of ``tensor``: followed by
    ``all_gather(out, tensor.numel(), out=tensor)`` that is an in-place all-reduce.
    """
    c = codecs.get(compress)
    with CollectiveGroup.borrow(group) as g:
        flat = _flat_fp32(tensor, staging.placement(g, tensor.device))
        stage = staging.begin(g, flat)
        return g.call(
            "reduce_scatter",
            lambda: run_reduce_scatter(
                g,
                flat,
                c,
                out=out,
                timeout=timeout,
                pipeline=pipeline_elements,
                small_bytes=small_bytes,
                stage=stage,
            ),
        )


def all_gather(
    partition: torch.Tensor,
    size: int,
    *,
    group: Group = None,
    compress: str | codecs.Codec = "none",
    out: torch.Tensor | None = None,
    timeout: float | None = None,
    pipeline_elements: int = DEFAULT_PIPELINE_ELEMENTS,
    small_bytes: int = SMALL_BYTES,
) -> torch.Tensor:
    """Put every rank's ``partition`` of a flat vector of ``size`` together (fp32).

    ``partition`` must have this rank's slice length. ``out`` (``size`` fp32
    elements) is filled when given, else a new vector is returned.
    """
    c = codecs.get(compress)
    with CollectiveGroup.borrow(group) as g:
        flat = _flat_fp32(partition, staging.placement(g, partition.device))
        # fp32 on the wire: the slice is copied into place by the all-gather itself.
        wire = flat if isinstance(c, codecs.NoCompression) else c.encode(flat)
        stage = staging.begin(g, wire)
        return g.call(
            "all_gather",
            lambda: run_all_gather(
                g,
                wire,
                size,
                c,
                out=out,
                timeout=timeout,
                pipeline=pipeline_elements,
                small_bytes=small_bytes,
                stage=stage,
            ),
        )


def all_reduce(
    tensor: torch.Tensor,
    *,
    group: Group = None,
    compress: str | codecs.Codec = "none",
    timeout: float | None = None,
    pipeline_elements: int = DEFAULT_PIPELINE_ELEMENTS,
    small_bytes: int = SMALL_BYTES,
) -> CollectiveFuture[torch.Tensor]:
    """Sum ``tensor`` over the ranks, in place; returns a future of ``tensor``.

    ``tensor`` must be contiguous fp32 (on a device the group carries or
    stages), the same number of elements on every rank; do not touch it until
    ``wait()`` returns. It is
    a reduce-scatter into this rank's own slice followed by an all-gather over
    the whole tensor (the same bits as :func:`reduce_scatter` +
    :func:`all_gather`, on every rank), on the group's transport; with
    transport ``"gloo"`` it is gloo's own ``all_reduce``.
    """
    c = codecs.get(compress)

    def submit(g: CollectiveGroup) -> CollectiveFuture[torch.Tensor]:
        flat = _check_out(tensor, tensor.numel(), g.device).view(-1)
        stage = staging.begin(g, flat)
        return g.submit(
            "all_reduce",
            lambda: run_all_reduce(
                g,
                flat,
                c,
                timeout=timeout,
                pipeline=pipeline_elements,
                small_bytes=small_bytes,
                stage=stage,
            ),
        )

    if isinstance(group, CollectiveGroup):
        return submit(group)
    # A wrapper made for this call is closed here, so the call completes before
    # it returns (pass a CollectiveGroup to overlap it with other work).
    with CollectiveGroup.borrow(group) as g:
        future = submit(g)
        future.wait()
        return future


# ------------------------------------------------ bodies (on the worker thread)
def run_all_reduce(
    group: CollectiveGroup,
    flat: torch.Tensor,
    codec: codecs.Codec,
    *,
    timeout: float | None = None,
    pipeline: int = DEFAULT_PIPELINE_ELEMENTS,
    small_bytes: int = SMALL_BYTES,
    name: str = "all_reduce",
    stage: Staging | None = None,
) -> torch.Tensor:
    """The in-place all-reduce of ``flat``; call it on the group's worker thread.

    ``stage``: what :func:`.staging.begin` gave for ``flat`` when the operation
    was called (the bodies here make one on the worker thread's current stream
    where the caller did not, for a group that stages ``flat``'s device).
    """
    op, transport = choice.begin(group, name, timeout, flat.device)
    chunking = Chunking(pipeline_elements=pipeline, small_bytes=small_bytes)
    staging.run(
        stage or staging.begin(group, flat),
        flat,
        flat,
        lambda x, _: transport.all_reduce(op, x, codec, chunking),
    )
    return flat


def run_reduce_scatter(
    group: CollectiveGroup,
    flat: torch.Tensor,
    codec: codecs.Codec,
    *,
    out: torch.Tensor | None = None,
    timeout: float | None = None,
    pipeline: int = DEFAULT_PIPELINE_ELEMENTS,
    small_bytes: int = SMALL_BYTES,
    name: str = "reduce_scatter",
    ranges: list[tuple[int, int]] | None = None,
    stage: Staging | None = None,
) -> torch.Tensor:
    """The reduce-scatter itself; call it on the group's worker thread.

    Returns ``out`` (or a new fp32 tensor) holding this rank's slice of the sum.
    ``ranges``: each rank's ``(start, length)`` in ``flat``, back to back in rank
    order and covering it (empty ones allowed; every rank gives the same);
    default: :func:`gradhub.partition.partition_ranges`. ``stage``: see
    :func:`run_all_reduce`.
    """
    if ranges is None:
        ranges = partition_ranges(flat.numel(), group.world_size)
    out = _check_out(out, ranges[group.rank][1], flat.device)
    op, transport = choice.begin(group, name, timeout, flat.device)
    chunking = Chunking(pipeline_elements=pipeline, small_bytes=small_bytes)
    staging.run(
        stage or staging.begin(group, flat),
        flat,
        out,
        lambda x, y: transport.reduce_scatter(op, x, codec, ranges, y.view(-1), chunking),
    )
    return out


def run_all_gather(
    group: CollectiveGroup,
    own_wire: torch.Tensor,
    size: int,
    codec: codecs.Codec,
    *,
    out: torch.Tensor | None = None,
    timeout: float | None = None,
    pipeline: int = DEFAULT_PIPELINE_ELEMENTS,
    small_bytes: int = SMALL_BYTES,
    name: str = "all_gather",
    stage: Staging | None = None,
    ranges: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """The all-gather of this rank's encoded slice; call it on the worker thread.

    Returns ``out`` (or a new fp32 vector of ``size`` on ``own_wire``'s device)
    holding every decoded slice. ``stage``: see :func:`run_all_reduce`.
    ``ranges``: each rank's ``(start, length)`` in ``out``, as :func:`run_reduce_scatter`
    takes them (default: :func:`gradhub.partition.partition_ranges`).
    """
    if ranges is None:
        ranges = partition_ranges(size, group.world_size)
    length = ranges[group.rank][1]
    if own_wire.numel() != length:
        raise ShapeMismatchError(
            f"<partition of rank {group.rank}>", [length], [own_wire.numel()], "length"
        )
    out = _check_out(out, size, own_wire.device)
    op, transport = choice.begin(group, name, timeout, own_wire.device)
    chunking = Chunking(pipeline_elements=pipeline, small_bytes=small_bytes)
    staging.run(
        stage or staging.begin(group, own_wire),
        own_wire,
        out,
        lambda x, y: transport.all_gather(op, x, codec, ranges, y.view(-1), chunking),
    )
    return out


def run_shared_vectors(
    group: CollectiveGroup, count: int, numel: int, *, timeout: float | None = None, name: str
) -> list[torch.Tensor] | None:
    """``count`` fp32 vectors of ``numel`` elements that the group's transport
    reads in place (:meth:`~gradhub.transports.base.Transport.shared_vector`),
    or ``None`` where it has none; call it on the worker thread."""
    op, transport = choice.begin(group, name, timeout)
    vectors = [transport.shared_vector(op, numel) for _ in range(count)]
    return None if any(v is None for v in vectors) else [v for v in vectors if v is not None]


def _check_out(out: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(numel, dtype=torch.float32, device=device)
    if out.numel() != numel or out.dtype != torch.float32 or not out.is_contiguous():
        raise ShapeMismatchError(
            "<out>",
            f"contiguous fp32 with {numel} elements",
            f"{out.dtype} with {out.numel()} elements, contiguous={out.is_contiguous()}",
        )
    return out


def _flat_fp32(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor.detach().reshape(-1).to(device=device, dtype=torch.float32).contiguous()
