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

Non-contiguous tensors go through contiguous copies that are copied back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradhub.collective import CollectiveGroup, all_gather, all_reduce, reduce_scatter
from gradhub.errors import UnsupportedTensorError

RedOp: Any = dist.ReduceOp.RedOpType
_TRANSPORT_OPS = (RedOp.SUM, RedOp.AVG, RedOp.PREMUL_SUM)


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


def _flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous vector: the tensor itself when it is one, else a copy;
    detached (the exchange is data movement, never recorded by autograd, also
    for tensors that require grad: DDP with ``create_graph=True``)."""
    if len(tensors) == 1 and tensors[0].is_contiguous():
        return tensors[0].detach().view(-1)
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _scatter_back(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    if len(tensors) == 1 and flat.data_ptr() == tensors[0].data_ptr():
        return
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
    flat = _flat(tensors)
    premultiply([flat], reduction)
    if ctx.size > 1:
        all_reduce(flat, group=ctx.group).wait()
    if reduction.kind == RedOp.AVG:
        flat.div_(ctx.size)
    _scatter_back(flat, tensors)


def transport_reduce_scatter(
    ctx: Context, output: torch.Tensor, chunks: Sequence[torch.Tensor], reduction: Reduction
) -> None:
    """``output`` = this rank's chunk of the reduction of every rank's ``chunks``
    (one chunk per rank, each ``output``'s size)."""
    flat = _flat(chunks)
    if len(chunks) == 1:  # never scale the caller's input in place
        flat = flat.clone() if reduction.kind == RedOp.PREMUL_SUM else flat
    premultiply([flat], reduction)
    direct = output.is_contiguous()
    out = output.detach() if direct else torch.empty_like(output.detach())
    reduce_scatter(flat, group=ctx.group, out=out.view(-1))
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
    all_gather(mine, n * ctx.size, group=ctx.group, out=gathered)
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
