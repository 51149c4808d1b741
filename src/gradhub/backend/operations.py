"""The bodies of the backend's operations; they run on the group's worker thread.

Two paths:

- **gradhub's transports** (:mod:`gradhub.collective`: shared memory on one
  host, hierarchical across hosts holding several ranks, the ring otherwise,
  chosen as ``gradhub.init`` chooses): all-reduce, reduce-scatter and
  all-gather of dense fp32 tensors with ``SUM``, ``AVG`` and ``PREMUL_SUM``.
- **the group's inner gloo group**, bounded and named through the same
  :class:`~gradhub.collective.CollectiveGroup`: everything else (other dtypes,
  ``MAX``/``MIN``/``PRODUCT``/``BAND``/``BOR``/``BXOR``, broadcast, all-to-all,
  barrier, gather, scatter, reduce), so those results are gloo's, bit for bit.

Numerics of the transport path (every rank ends with the same bits):

- The sum of element ``i`` is formed by the rank ``r`` that owns the slice
  holding ``i`` (slices per :func:`gradhub.partition.partition_ranges`) as
  ``((x[r+1] + x[r+2]) + ...) + x[r]`` (ranks modulo the group size, the
  owner's own value last; :func:`gradhub.collective.schedule.reduction_order`),
  in fp32, and handed to every rank unchanged. With two ranks that is the sum
  gloo forms (fp32 addition commutes), so DDP's gradients agree with gloo's
  bit for bit; with more ranks the association differs from gloo's ring, a
  difference of at most ``(P - 1)`` roundings of the sum's magnitude.
  ``hierarchical`` adds each host's values first (see its module).
- ``AVG`` is that sum divided by the group size on every rank;
  ``PREMUL_SUM(f)`` multiplies each rank's input by ``f`` before the sum.

Non-contiguous tensors go through contiguous copies that are copied back;
tensors that lie back to back in one storage (``reduce_scatter_tensor``'s
chunks of one input) are read in place, as one vector.

The bodies call the collectives' own bodies (:func:`gradhub.collective.ring.run_all_reduce`
and its siblings) on the group's worker thread itself: the transports' group
belongs to this process group alone and its operations already run one at a
time, in call order, on that thread, so a second thread hop per operation
would add a wake-up (two under load) and nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradhub import codecs
from gradhub.collective import CollectiveGroup
from gradhub.collective.ring import run_all_gather, run_all_reduce, run_reduce_scatter
from gradhub.errors import UnsupportedTensorError

RedOp: Any = dist.ReduceOp.RedOpType
_TRANSPORT_OPS = (RedOp.SUM, RedOp.AVG, RedOp.PREMUL_SUM)
_PLAIN = codecs.NoCompression()


@dataclass(frozen=True)
class Reduction:
    """A ``ReduceOp`` read once: its kind and, for ``PREMUL_SUM``, its factor."""

    kind: Any
    factor: float | None = None

    @classmethod
    def of(cls, op: Any) -> Reduction:
        kind = getattr(op, "op", op)
        factor = getattr(op, "factor", None) if kind == RedOp.PREMUL_SUM else None
        return cls(kind, None if factor is None else float(factor))

    def gloo_op(self) -> dist.ReduceOp:
        """The op gloo runs after :meth:`premultiply` (``PREMUL_SUM`` becomes ``SUM``)."""
        return dist.ReduceOp(RedOp.SUM if self.kind == RedOp.PREMUL_SUM else self.kind)


@dataclass
class Context:
    """What an operation body needs: the transports' group and the inner gloo group."""

    group: CollectiveGroup
    gloo: dist.ProcessGroup

    @property
    def size(self) -> int:
        return self.group.world_size


def on_transport(tensors: Sequence[torch.Tensor], reduction: Reduction | None = None) -> bool:
    """Whether gradhub's transports carry this operation (dense fp32, a sum)."""
    if reduction is not None and reduction.kind not in _TRANSPORT_OPS:
        return False
    return all(t.dtype == torch.float32 and t.layout == torch.strided for t in tensors)


def premultiply(tensors: Sequence[torch.Tensor], reduction: Reduction) -> None:
    if reduction.kind == RedOp.PREMUL_SUM and reduction.factor is not None:
        for t in tensors:
            if not t.is_floating_point():
                raise UnsupportedTensorError(
                    f"PREMUL_SUM needs floating-point tensors, got {t.dtype}\n"
                    "- help: multiply the integers yourself and use ReduceOp.SUM"
                )
            t.mul_(reduction.factor)


def _flat(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """One contiguous vector of ``tensors`` and whether it is their own memory:
    the tensors themselves when they are one contiguous tensor or contiguous
    pieces back to back in one storage, else a copy; detached (the exchange is
    data movement, never recorded by autograd, also for tensors that require
    grad: DDP with ``create_graph=True``)."""
    first = tensors[0].detach()
    if _adjacent(tensors):
        total = sum(t.numel() for t in tensors)
        return first.as_strided((total,), (1,)), True
    return torch.cat([t.detach().reshape(-1) for t in tensors]), False


def _adjacent(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` are contiguous, of one dtype, back to back in one storage."""
    first = tensors[0]
    if not first.is_contiguous():
        return False
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
def transport_all_reduce(
    ctx: Context, tensors: Sequence[torch.Tensor], reduction: Reduction
) -> None:
    """In-place fp32 all-reduce of ``tensors`` (coalesced into one vector)."""
    flat, in_place = _flat(tensors)
    premultiply([flat], reduction)
    if ctx.size > 1:
        run_all_reduce(ctx.group, flat, _PLAIN)
    if reduction.kind == RedOp.AVG:
        flat.div_(ctx.size)
    if not in_place:
        _scatter_back(flat, tensors)


def transport_reduce_scatter(
    ctx: Context, output: torch.Tensor, chunks: Sequence[torch.Tensor], reduction: Reduction
) -> None:
    """``output`` = this rank's chunk of the reduction of every rank's ``chunks``
    (one chunk per rank, each ``output``'s size)."""
    flat, callers = _flat(chunks)
    direct = output.is_contiguous()
    out = output.detach() if direct else torch.empty_like(output.detach())
    # Never scale the caller's input; and read it in place only where the
    # output is this rank's own chunk of it or lies outside it.
    own = chunks[ctx.group.rank]
    if callers and (
        reduction.kind == RedOp.PREMUL_SUM
        or (_overlaps(out, flat) and out.data_ptr() != own.data_ptr())
    ):
        flat = flat.clone()
    premultiply([flat], reduction)
    run_reduce_scatter(ctx.group, flat, _PLAIN, out=out.view(-1))
    if reduction.kind == RedOp.AVG:
        out.div_(ctx.size)
    if not direct:
        output.copy_(out)


def transport_all_gather(
    ctx: Context, outputs: Sequence[torch.Tensor], tensor: torch.Tensor
) -> None:
    """``outputs[r]`` = rank ``r``'s ``tensor`` (all of one size)."""
    n = tensor.numel()
    if len(outputs) == 1 and outputs[0].is_contiguous():
        gathered = outputs[0].detach().view(-1)
    else:
        gathered = torch.empty(n * ctx.size, dtype=torch.float32)
    mine = tensor.detach().reshape(-1).contiguous()
    run_all_gather(ctx.group, mine, n * ctx.size, _PLAIN, out=gathered)
    if len(outputs) == 1:
        if gathered.data_ptr() != outputs[0].data_ptr():
            outputs[0].copy_(gathered.view_as(outputs[0]))
        return
    for r, o in enumerate(outputs):
        o.copy_(gathered[r * n : (r + 1) * n].view_as(o))


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


def _refused(name: str, exc: RuntimeError) -> UnsupportedTensorError:
    return UnsupportedTensorError(
        f"{name}: {str(exc).strip()}\n- help: the gradhub backend takes what gloo takes on CPU"
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
