"""The bodies of the backend's operations; they run on the group's worker thread.

Two paths:

- **gradhub's transports** (shared memory on one host, hierarchical across
  hosts holding several ranks, the ring otherwise, chosen as ``gradhub.init``
  chooses): all-reduce, reduce-scatter and all-gather of dense fp32, bf16 and
  fp16 tensors (reductions: ``SUM``, ``AVG`` and ``PREMUL_SUM``), broadcast
  of any dense tensor, and barrier (a one-element sum).
- **the group's inner gloo group**, bounded and named through the same
  :class:`~gradhub.collective.CollectiveGroup`: everything else (other dtypes,
  ``MAX``/``MIN``/``PRODUCT``/``BAND``/``BOR``/``BXOR``, all-to-all,
  gather, scatter, reduce), so those results are gloo's, bit for bit.

Arguments were checked on the calling rank before the body was queued
(:mod:`gradhub.backend.checks`), so a body fails only when a peer dies or
stalls, which breaks the group.

Numerics of the transport path (every rank ends with the same bits):

- **fp32.** The sum of element ``i`` is formed by the rank ``r`` that owns the
  slice holding ``i`` (slices per :func:`gradhub.partition.partition_ranges`) as
  ``((x[r+1] + x[r+2]) + ...) + x[r]`` (ranks modulo the group size, the
  owner's own value last; :func:`gradhub.transports.schedule.reduction_order`),
  in fp32, and handed to every rank unchanged. With two ranks that is the sum
  gloo forms (fp32 addition commutes), so DDP's gradients agree with gloo's
  bit for bit; with more ranks the association differs from gloo's ring, a
  difference of at most ``(P - 1)`` roundings of the sum's magnitude.
  ``hierarchical`` adds each host's values first (see its module).
- **bf16 and fp16.** Each rank's values are widened to fp32 (exactly),
  summed in fp32 in the order above, and the sum is rounded to the tensor's
  dtype once (to nearest even; beyond the dtype's range: inf). The ring and
  ``gloo`` send the 16-bit values themselves (the 16-bit wire codecs of
  :mod:`gradhub.codecs`) on their collective path at every size, which
  rounds each contribution to 16 bits (no change here) and never a partial
  sum per hop; shared memory carries the 16-bit values too and forms each
  sum in fp32 as it adds (:mod:`gradhub.transports.shm_sums`: no fp32 copy of
  the vector), ``hierarchical`` the fp32 values (its ring between hosts would
  round per hop). So every transport gives the same bits, ``hierarchical``
  those of its own order.
  gloo adds two values in fp32 and rounds to 16 bits after every addition:
  with two ranks that is one addition, the same bits. With ``P > 2`` ranks
  gloo rounds ``P - 1`` times where this rounds once: with ``u`` the dtype's
  unit roundoff (``2**-8`` bf16, ``2**-11`` fp16) and ``S = sum(|x_r|)`` over
  the ranks, the two differ by at most ``(P * u + 2 * (P - 1) * 2**-24) * S``
  per element (gloo's error is up to ``(P - 1) * u * S``, this one's
  ``u * |sum| + (P - 1) * 2**-24 * S``), and where one of gloo's partial sums
  overflows the dtype (fp16: 65504) gloo gives inf and this the finite sum.
  Tested: gloo's bits with two ranks on each transport, the bound with three
  (shared memory) and four (two hosts of two) ranks.
- ``AVG``: fp32: the fp32 sum divided by the group size; bf16/fp16: the
  rounded sum divided by the group size in the tensor's dtype (gloo's order:
  the same bits with two ranks). ``PREMUL_SUM(f)`` multiplies each rank's
  input by ``f`` (in its dtype) before the sum.
- All-gather and broadcast move the values unchanged (a 16-bit NaN stays a
  NaN, its payload bits may not; broadcast moves bytes, also those).

Non-contiguous tensors go through contiguous copies that are copied back;
fp32 tensors that lie back to back in one storage (``reduce_scatter_tensor``'s
chunks of one input) are read in place, as one vector; so are 16-bit
tensors summed in shared memory (an all-reduce); elsewhere 16-bit tensors
are widened into an fp32 vector of the group's (reused between operations).

The bodies call the transport (:class:`~gradhub.transports.base.Transport`)
on the group's worker thread itself: the transports' group belongs to this
process group alone and its operations already run one at a time, in call
order, on that thread, so a second thread hop per operation would add a
wake-up (two under load) and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradhub import codecs
from gradhub.collective import CollectiveGroup
from gradhub.errors import CollectiveArgumentError
from gradhub.transports import choice
from gradhub.transports.base import Chunking, Transport
from gradhub.transports.c10d_errors import first_line
from gradhub.transports.operation import Operation

RedOp: Any = dist.ReduceOp.RedOpType
_TRANSPORT_OPS = frozenset(int(k) for k in (RedOp.SUM, RedOp.AVG, RedOp.PREMUL_SUM))
_PLAIN = codecs.NoCompression()
WIRE: dict[torch.dtype, codecs.Codec] = {
    torch.float32: _PLAIN,
    torch.bfloat16: codecs.BF16(),
    torch.float16: codecs.FP16(saturate=False),  # overflow is inf, as gloo's
}
"""The dtypes the transports carry, each with the wire codec that sends its own values."""
_DEFAULT = Chunking()
_EVERY_SIZE = Chunking(small_bytes=1 << 62)
"""The transports' collective path at every size (16-bit sums: no rounding per hop)."""


@dataclass(frozen=True)
class Reduction:
    """A ``ReduceOp`` read once: its kind, for ``PREMUL_SUM`` its factor, and what
    the operations ask of it as plain booleans (a comparison of torch's enum
    costs about a microsecond, several per call)."""

    kind: Any
    factor: float | None = None
    is_sum: bool = field(init=False)
    is_average: bool = field(init=False)
    is_premul: bool = field(init=False)
    on_transport: bool = field(init=False)
    """Whether gradhub's transports carry this reduction (a sum)."""

    def __post_init__(self) -> None:
        code = int(self.kind)
        object.__setattr__(self, "is_sum", code == int(RedOp.SUM))
        object.__setattr__(self, "is_average", code == int(RedOp.AVG))
        object.__setattr__(self, "is_premul", code == int(RedOp.PREMUL_SUM))
        object.__setattr__(self, "on_transport", code in _TRANSPORT_OPS)

    @classmethod
    def of(cls, op: Any) -> Reduction:
        kind = getattr(op, "op", op)
        plain = _PLAIN_REDUCTIONS.get(int(kind))
        if plain is not None:
            return plain
        factor = getattr(op, "factor", None) if kind == RedOp.PREMUL_SUM else None
        return cls(kind, None if factor is None else float(factor))

    def gloo_op(self) -> dist.ReduceOp:
        """The op gloo runs after :meth:`premultiply` (``PREMUL_SUM`` becomes ``SUM``)."""
        return dist.ReduceOp(RedOp.SUM if self.is_premul else self.kind)


_PLAIN_REDUCTIONS = {
    int(kind): Reduction(kind) for kind in RedOp.__members__.values() if kind != RedOp.PREMUL_SUM
}
"""One :class:`Reduction` per kind without a factor: read per call, made once."""


@dataclass
class Context:
    """What an operation body needs: the transports' group and the inner gloo group."""

    group: CollectiveGroup
    gloo: dist.ProcessGroup

    @property
    def size(self) -> int:
        return self.group.world_size


def on_transport(tensors: Sequence[torch.Tensor], reduction: Reduction | None = None) -> bool:
    """Whether gradhub's transports carry this operation (dense tensors of one
    dtype of :data:`WIRE`; a sum)."""
    if reduction is not None and not reduction.on_transport:
        return False
    return bool(tensors) and all(
        t.dtype == tensors[0].dtype and t.dtype in WIRE and t.layout == torch.strided
        for t in tensors
    )


def plain_sum(tensors: Sequence[torch.Tensor], reduction: Reduction) -> bool:
    """Whether this is one dense CPU tensor of a dtype of :data:`WIRE` (floating,
    and gloo's), summed or averaged: a call that passes every check of
    :mod:`.checks` and runs on the transports, so its checks, which would cost
    a tenth of a small all-reduce's time, need not run."""
    if len(tensors) != 1 or not reduction.on_transport:
        return False
    t = tensors[0]
    return t.dtype in WIRE and t.is_cpu and t.layout == torch.strided


def nbytes(tensors: Sequence[torch.Tensor]) -> int:
    """The bytes of ``tensors`` together."""
    return sum(t.numel() * t.element_size() for t in tensors)


def premultiply(tensors: Sequence[torch.Tensor], reduction: Reduction) -> None:
    """Multiply by ``PREMUL_SUM``'s factor in place (floating-point tensors:
    :mod:`.checks` refused the others)."""
    if reduction.is_premul and reduction.factor is not None:
        for t in tensors:
            t.mul_(reduction.factor)


def _flat(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """One contiguous vector of ``tensors`` and whether it is their own memory:
    the tensors themselves when they are one contiguous tensor or contiguous
    pieces back to back in one storage, else a copy; detached (the exchange is
    data movement, never recorded by autograd, also for tensors that require
    grad: DDP with ``create_graph=True``)."""
    first = tensors[0].detach()
    if len(tensors) == 1 and first.is_contiguous():  # the common call, at half the cost
        return (first if first.dim() == 1 else first.view(-1)), True
    if _adjacent(tensors):
        total = sum(t.numel() for t in tensors)
        return first.as_strided((total,), (1,)), True
    return torch.cat([t.detach().reshape(-1) for t in tensors]), False


def _adjacent(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are contiguous, of one dtype, back to back in one storage."""
    first = tensors[0]
    if not first.is_contiguous():
        return False
    if len(tensors) == 1:
        return True
    end = first.data_ptr() + first.numel() * first.element_size()
    storage = first.untyped_storage().data_ptr()
    for t in tensors[1:]:
        if (
            not t.is_contiguous()
            or t.dtype != first.dtype
            or t.untyped_storage().data_ptr() != storage
            or t.data_ptr() != end
        ):
            return False
        end += t.numel() * t.element_size()
    return True


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of contiguous ``a`` and ``b`` intersects."""
    a_end = a.data_ptr() + a.numel() * a.element_size()
    b_end = b.data_ptr() + b.numel() * b.element_size()
    return a.data_ptr() < b_end and b.data_ptr() < a_end


def _scatter_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` (a copy :func:`_flat` made) back into ``tensors``."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset : offset + n].view_as(t))
        offset += n


# ---------------------------------------------------------------- transports
def _begin(ctx: Context, name: str) -> tuple[Operation, Transport]:
    """Begin operation ``name`` on the transports' group; its transport."""
    return choice.begin(ctx.group, name)


def _summing(transport: Transport, dtype: torch.dtype) -> tuple[codecs.Codec, Chunking]:
    """The wire codec and chunking of a sum of ``dtype`` values (module docstring):
    the values as they are in memory (``shm``: fp32, or 16-bit values summed in
    fp32; ``hierarchical``: fp32, its ring between hosts would round per hop),
    the 16-bit values over a network, summed without rounding."""
    if dtype == torch.float32 or transport.name in ("shm", "hierarchical"):
        return _PLAIN, _DEFAULT
    return WIRE[dtype], _EVERY_SIZE


def _equal(n: int, size: int) -> list[tuple[int, int]]:
    return [(r * n, n) for r in range(size)]


def _widened(ctx: Context, tensors: Sequence[torch.Tensor], reduction: Reduction) -> torch.Tensor:
    """The fp32 values of 16-bit ``tensors`` back to back (premultiplied in
    their own dtype), in a vector of the group's."""
    flat = ctx.group.scratch("backend_widened", sum(t.numel() for t in tensors), torch.float32)
    at = 0
    for t in tensors:
        source = t.detach()
        if reduction.is_premul and reduction.factor is not None:
            source = source * reduction.factor
        flat[at : at + t.numel()].view(t.shape).copy_(source)
        at += t.numel()
    return flat


def transport_all_reduce(
    ctx: Context, name: str, tensors: Sequence[torch.Tensor], reduction: Reduction
) -> None:
    """In-place all-reduce of ``tensors`` (one dtype of :data:`WIRE`, coalesced into one vector)."""
    dtype = tensors[0].dtype
    op, transport = _begin(ctx, name) if ctx.size > 1 else (None, None)
    if dtype == torch.float32 or transport is None or transport.name == "shm":
        flat, in_place = _flat(tensors)  # shm sums 16-bit values where they lie
        premultiply([flat], reduction)
    else:
        flat, in_place = _widened(ctx, tensors, reduction), False
    if transport is not None and op is not None:
        codec, chunking = _summing(transport, dtype)
        transport.all_reduce(op, flat, codec, chunking)
    average = reduction.is_average
    if average and dtype == torch.float32:
        flat.div_(ctx.size)
    if not in_place:
        _scatter_back(flat, tensors)
    if average and dtype != torch.float32:  # the rounded sum, divided in its dtype (gloo's)
        for t in tensors:
            t.div_(ctx.size)


def transport_reduce_scatter(
    ctx: Context,
    name: str,
    output: torch.Tensor,
    chunks: Sequence[torch.Tensor],
    reduction: Reduction,
) -> None:
    """``output`` = this rank's chunk of the reduction of every rank's ``chunks``
    (one chunk per rank, each ``output``'s size)."""
    n, dtype = output.numel(), output.dtype
    if dtype == torch.float32:
        flat, callers = _flat(chunks)
        direct = output.is_contiguous()
        out = output.detach() if direct else torch.empty(output.shape, dtype=dtype)
        # Never scale the caller's input; and read it in place only where the
        # output is this rank's own chunk of it or lies outside it.
        own = chunks[ctx.group.rank]
        if callers and (
            reduction.is_premul or (_overlaps(out, flat) and out.data_ptr() != own.data_ptr())
        ):
            flat = flat.clone()
        premultiply([flat], reduction)
    else:
        flat = _widened(ctx, chunks, reduction)
        direct, out = False, ctx.group.scratch("backend_sum", n, torch.float32)
    op, transport = _begin(ctx, name)
    codec, chunking = _summing(transport, dtype)
    transport.reduce_scatter(op, flat, codec, _equal(n, ctx.size), out.view(-1), chunking)
    if reduction.is_average and dtype == torch.float32:
        out.div_(ctx.size)
    if not direct:
        output.copy_(out.view(output.shape))
    if reduction.is_average and dtype != torch.float32:
        output.div_(ctx.size)


def transport_all_gather(
    ctx: Context, name: str, outputs: Sequence[torch.Tensor], tensor: torch.Tensor
) -> None:
    """``outputs[r]`` = rank ``r``'s ``tensor`` (all of one size and dtype of :data:`WIRE`)."""
    n, dtype = tensor.numel(), tensor.dtype
    if dtype == torch.float32 and len(outputs) == 1 and outputs[0].is_contiguous():
        gathered = outputs[0].detach().view(-1)
    else:
        gathered = ctx.group.scratch("backend_gathered", n * ctx.size, torch.float32)
    mine = tensor.detach().reshape(-1).contiguous()  # the wire values: its own
    op, transport = _begin(ctx, name)
    transport.all_gather(op, mine, WIRE[dtype], _equal(n, ctx.size), gathered, _DEFAULT)
    if len(outputs) == 1:
        if gathered.data_ptr() != outputs[0].data_ptr():
            outputs[0].copy_(gathered.view(outputs[0].shape))
        return
    for r, o in enumerate(outputs):
        o.copy_(gathered[r * n : (r + 1) * n].view(o.shape))


def transport_broadcast(ctx: Context, name: str, tensor: torch.Tensor, root: int) -> None:
    """``tensor`` (contiguous) = rank ``root``'s, byte for byte."""
    if ctx.size > 1:
        op, transport = _begin(ctx, name)
        transport.broadcast(op, tensor.detach(), root)


# ---------------------------------------------------------------------- gloo
def on_gloo(ctx: Context, name: str, call: Any, peer: int | None = None) -> None:
    """Run ``call(gloo_group)`` (which returns a c10d ``Work``) within the group's
    timeout; a failure is gradhub's error naming the rank (``peer``: the rank
    the operation depends on, when one does)."""
    op = ctx.group.begin(name)
    try:
        work = call(ctx.gloo)
    except RuntimeError as exc:  # gloo refused the call itself (bad arguments)
        raise _refused(name, exc) from exc
    ctx.group.wait(op, work, peer)


def _refused(name: str, exc: RuntimeError) -> CollectiveArgumentError:
    return CollectiveArgumentError(
        f"{name}: {first_line(exc)}\n- help: the gradhub backend takes what gloo takes on CPU"
    )


def contiguous(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Contiguous stand-ins for ``tensors`` and the indexes that were copied."""
    out, copied = [], []
    for i, t in enumerate(tensors):
        if t.layout == torch.strided and not t.is_contiguous():
            out.append(t.contiguous())
            copied.append(i)
        else:
            out.append(t)
    return out, copied


def copy_back(
    originals: Sequence[torch.Tensor], stand_ins: Sequence[torch.Tensor], copied: list[int]
) -> None:
    for i in copied:
        originals[i].copy_(stand_ins[i])
