"""Reduce-scatter and all-gather with compressed wire data.

``reduce_scatter(x)`` leaves rank ``r`` with the sum over ranks of its own
slice of ``x`` (slices per :func:`gradhub.partition.partition_range`, uneven
and empty slices included); ``all_gather(slice, size)`` puts every rank's
slice together again. Both are bounded by the group's timeout.

gloo: a ring of point-to-point ``isend``/``irecv`` (:mod:`.schedule`). Each
rank sends ``(P-1)/P`` of the bytes once per collective, to its right-hand
neighbour only. gloo's own reduce-scatter is built from one all-reduce per
rank, which is why it is not used.

- Every receive of an operation is posted before the first send, so no
  message waits for its receiver to get ready.
- Chunks are cut into messages of at most ``pipeline_elements`` elements: a
  rank adds (or forwards) one message while the next one is on the wire.
- Wire data is in the codec's type. Each hop decodes, adds its own fp32 values
  in fp32, and encodes the partial sum once for the next hop; the owner adds
  its values last and keeps the fp32 sum. With ``"fp16"`` every contribution
  is divided by ``P`` before it is encoded, so partial sums stay within the
  half range, and the result is multiplied back by ``P``: the functions
  always return the plain sum. With a lossy codec, the error of the sum is
  at most ``(P - 1) * relative_error * sum(|x_i|)`` (one rounding per hop).
- The all-gather forwards wire bytes unchanged, and every rank, the owner
  included, decodes the same bytes: all ranks end with the same bits.
- Summation order is fixed (:func:`.schedule.reduction_order`), so the result
  is bit-identical run to run and on every rank.

Small vectors (at most :data:`SMALL_BYTES` on the wire) on gloo, and every
lossy codec on NCCL, use collectives instead: the reduce-scatter is one
``all_to_all_single`` of encoded slices (the same (P-1)/P of the bytes)
followed by an fp32 sum in :func:`.schedule.reduction_order`, which for
``"none"`` gives the ring's bits exactly and for lossy codecs rounds once
instead of once per hop; the all-gather is ``all_gather_single`` of padded
slices. gloo's point-to-point messages have a high fixed cost (see
:data:`SMALL_BYTES`), its collectives do not.

NCCL with ``"none"``: the native reduce-scatter (``reduce_scatter_single``;
``reduce_scatter_tensor`` before torch 2.13), slices padded to equal length;
its summation order is NCCL's (deterministic for a fixed topology), not the
ring's. With a lossy codec NCCL would add in the wire type, hence the
``all_to_all_single`` path above.

The group's transport (:mod:`.transport`) may send the operation through
shared memory (:mod:`.shm`, one host) or the hierarchical path
(:mod:`.hierarchical`: shared memory inside each host, the point-to-point
ring between hosts at every size) instead.

Operations run on the group's worker thread in the order they are called
(:meth:`CollectiveGroup.submit`), so several callers cannot interleave
differently on different ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradhub import codecs
from gradhub.errors import ShapeMismatchError
from gradhub.partition import partition_ranges
from gradhub.transports.choice import chosen, select
from gradhub.transports.group import CollectiveFuture, CollectiveGroup, Operation
from gradhub.transports.hierarchical import HierarchicalTransport
from gradhub.transports.p2p_ring import ring_all_gather, ring_reduce_scatter
from gradhub.transports.schedule import (
    reduction_order,
)

DEFAULT_PIPELINE_ELEMENTS = 1 << 21
"""Elements per message (8 MiB of fp32). Large enough that per-message costs
vanish, small enough that adding overlaps the transfer; see
``benchmarks/collectives.py``. Every rank must use the same value."""

SMALL_BYTES = 4 << 20
"""Vectors of at most this many wire bytes use the backend's own collectives
(``all_to_all_single`` + ``all_gather_single``) on gloo too: gloo's
point-to-point messages cost ~3 ms each way back to back on the 2-core
benchmark machine, where its collectives cost well under 1 ms; from about 4M
fp32 elements on, the ring's halved bytes win. See ``benchmarks/collectives.py``.
Every rank must use the same value."""

Group = CollectiveGroup | dist.ProcessGroup | None

# torch 2.13 renamed the tensor collectives (the old names warn); older torch
# has only the old names.
_reduce_scatter_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
        flat = _flat_fp32(tensor, g.device)
        return g.submit(
            "reduce_scatter",
            lambda: run_reduce_scatter(
                g,
                flat,
                c,
                out=out,
                timeout=timeout,
                pipeline=pipeline_elements,
                small_bytes=small_bytes,
            ),
        ).wait()


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
        flat = _flat_fp32(partition, g.device)
        # fp32 on the wire: the slice is copied into place by the all-gather itself.
        wire = flat if isinstance(c, codecs.NoCompression) else c.encode(flat)
        return g.submit(
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
            ),
        ).wait()


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

    ``tensor`` must be contiguous fp32 on the group's device, the same number
    of elements on every rank; do not touch it until ``wait()`` returns. It is
    a reduce-scatter into this rank's own slice followed by an all-gather over
    the whole tensor (the same bits as :func:`reduce_scatter` +
    :func:`all_gather`, on every rank), on the group's transport; with
    transport ``"gloo"`` it is gloo's own ``all_reduce``.
    """
    c = codecs.get(compress)

    def submit(g: CollectiveGroup) -> CollectiveFuture[torch.Tensor]:
        flat = _check_out(tensor, tensor.numel(), g.device).view(-1)
        return g.submit(
            "all_reduce",
            lambda: run_all_reduce(
                g, flat, c, timeout=timeout, pipeline=pipeline_elements, small_bytes=small_bytes
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
) -> torch.Tensor:
    """The in-place all-reduce of ``flat``; call it on the group's worker thread."""
    plain = isinstance(codec, codecs.NoCompression)
    if group.world_size > 1 and plain and chosen(group) == "gloo":
        op = group.begin("all_reduce", timeout)
        group.wait(op, dist.all_reduce(flat, group=group.process_group, async_op=True), None)
        return flat
    start, length = partition_ranges(flat.numel(), group.world_size)[group.rank]
    own = flat[start : start + length]
    run_reduce_scatter(
        group, flat, codec, out=own, timeout=timeout, pipeline=pipeline, small_bytes=small_bytes
    )
    wire = own if plain else codec.encode(own)
    return run_all_gather(
        group,
        wire,
        flat.numel(),
        codec,
        out=flat,
        timeout=timeout,
        pipeline=pipeline,
        small_bytes=small_bytes,
    )


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
) -> torch.Tensor:
    """The reduce-scatter itself; call it on the group's worker thread.

    Returns ``out`` (or a new fp32 tensor) holding this rank's slice of the sum.
    ``ranges``: each rank's ``(start, length)`` in ``flat``, back to back in rank
    order and covering it (empty ones allowed; every rank gives the same);
    default: :func:`gradhub.partition.partition_ranges`.
    """
    if ranges is None:
        ranges = partition_ranges(flat.numel(), group.world_size)
    start, length = ranges[group.rank]
    out = _check_out(out, length, flat.device)
    # shared memory's own counters say who entered: no store round trip
    op = group.begin(name, timeout, check_in=chosen(group) != "shm")
    flat_out = out.view(-1)
    if group.world_size == 1:
        flat_out.copy_(flat[start : start + length])
        return out
    plain = isinstance(codec, codecs.NoCompression)
    path, shared = select(group, op)
    small = path == "gloo" or flat.numel() * codec.bytes_per_element <= small_bytes
    if isinstance(shared, HierarchicalTransport):
        shared.reduce_scatter(op, flat, codec, ranges, flat_out, pipeline)
    elif shared is not None:
        shared.reduce_scatter(op, flat, codec, [[c] for c in ranges], flat_out, hop=not small)
    elif group.backend == "nccl" and plain:
        _native_reduce_scatter(group, op, flat, ranges, flat_out)
    elif group.backend == "nccl" or small:
        _exchange_reduce_scatter(group, op, flat, codec, ranges, flat_out)
    else:
        prescale = codec.wire_dtype == torch.float16
        x = flat
        if prescale:
            x = torch.div(
                flat, group.world_size, out=group.scratch("prescale", flat.numel(), flat.dtype)
            )
        ring_reduce_scatter(group, op, x, codec, ranges, pipeline, flat_out)
        if prescale:
            out.mul_(group.world_size)
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
) -> torch.Tensor:
    """The all-gather of this rank's encoded slice; call it on the worker thread.

    Returns ``out`` (or a new fp32 vector of ``size``) holding every decoded slice.
    """
    ranges = partition_ranges(size, group.world_size)
    start, length = ranges[group.rank]
    if own_wire.numel() != length:
        raise ShapeMismatchError(
            f"<partition of rank {group.rank}>", [length], [own_wire.numel()], "length"
        )
    out = _check_out(out, size, group.device)
    # shared memory's own counters say who entered: no store round trip
    op = group.begin(name, timeout, check_in=chosen(group) != "shm")
    if group.world_size == 1:
        out.view(-1)[start : start + length].copy_(codec.decode(own_wire))
        return out
    path, shared = select(group, op)
    if isinstance(shared, HierarchicalTransport):
        shared.all_gather(op, own_wire, codec, ranges, out.view(-1), pipeline)
        return out
    if shared is not None:
        shared.all_gather(op, own_wire, codec, [[c] for c in ranges], out.view(-1))
        return out
    if path == "gloo" or group.backend == "nccl" or size * codec.bytes_per_element <= small_bytes:
        _collective_all_gather(group, op, own_wire, out, codec, ranges)
        return out
    direct = codec.wire_dtype == torch.float32
    wire = out.view(-1) if direct else group.scratch("all_gather", size, codec.wire_dtype)
    wire[start : start + length].copy_(own_wire)
    ring_all_gather(group, op, wire, ranges, pipeline)
    if not direct:
        out.view(-1).copy_(codec.decode(wire))
    return out


# ---------------------------------------- collective-based (NCCL, small on gloo)
def _padded(ranges: list[tuple[int, int]]) -> int:
    return max(n for _, n in ranges)


def _native_reduce_scatter(
    group: CollectiveGroup,
    op: Operation,
    x: torch.Tensor,
    ranges: list[tuple[int, int]],
    out: torch.Tensor,
) -> None:
    """NCCL's own fp32 reduce-scatter (slices padded to equal length)."""
    P, r = group.world_size, group.rank
    width = _padded(ranges)
    send = x
    if any(n != width for _, n in ranges):
        send = group.scratch("rs_padded", P * width, torch.float32).zero_()
        for c, (s, n) in enumerate(ranges):
            send[c * width : c * width + n].copy_(x[s : s + n])
    result = group.scratch("rs_result", width, torch.float32)
    work = _reduce_scatter_native(result, send, group=group.process_group, async_op=True)
    group.wait(op, work, None)
    out.copy_(result[: ranges[r][1]])


def _exchange_reduce_scatter(
    group: CollectiveGroup,
    op: Operation,
    x: torch.Tensor,
    codec: codecs.Codec,
    ranges: list[tuple[int, int]],
    out: torch.Tensor,
) -> None:
    """Reduce-scatter as one ``all_to_all_single`` of encoded slices (each rank
    receives every rank's copy of its own slice: (P-1)/P of the bytes), then an
    fp32 sum in :func:`.schedule.reduction_order`. For "none" that is the ring's
    order, so the two paths give the same bits."""
    P, r = group.world_size, group.rank
    length = ranges[r][1]
    send = x if isinstance(codec, codecs.NoCompression) else codec.encode(x)
    inbox = group.scratch("rs_inbox", P * length, codec.wire_dtype)
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


def _collective_all_gather(
    group: CollectiveGroup,
    op: Operation,
    own_wire: torch.Tensor,
    out: torch.Tensor,
    codec: codecs.Codec,
    ranges: list[tuple[int, int]],
) -> None:
    """All-gather with the backend's own collective (slices padded to equal length)."""
    P = group.world_size
    width = _padded(ranges)
    mine = group.scratch("ag_mine", width, codec.wire_dtype)
    mine[: own_wire.numel()].copy_(own_wire)
    gathered = group.scratch("ag_gathered", P * width, codec.wire_dtype)
    work = _all_gather_native(gathered, mine, group=group.process_group, async_op=True)
    group.wait(op, work, None)
    flat = out.view(-1)
    for c, (s, n) in enumerate(ranges):
        flat[s : s + n].copy_(codec.decode(gathered[c * width : c * width + n]))


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
