"""The gradient buckets of ``sharded``: reduce-scattered, then gathered, during backward.

The flat gradient vector (the parameters' order) is cut into buckets of
about ``bucket_mb`` megabytes, last parameters first (backward's order).
Each parameter's accumulated ``.grad`` is noted as its hook fires; once a
bucket's are all there, they are copied into their slots in one operation
(``torch._foreach_copy_``), the bucket is multiplied by this rank's weight
in one more (each element rounded once: the bits of a per-parameter
``mul``), and its reduce-scatter starts at once on the group's worker,
buckets strictly in the same order on every rank
(:meth:`~gradhub.collective.AllReduceParameter.put_gradient_segment`).
Per parameter and step the host then does no tensor operation of its own.

With ``gather=True`` the bucket's all-gather is queued right behind its
reduce-scatter: each rank's summed part of the bucket (encoded with the
gradient codec, which every codec does element by element) goes back into
the bucket's place in the flat vector while the backward goes on, so only
the last bucket's exchange is left when backward ends. The bits are those
of one all-gather of the whole summed vector after the backward. Without
it (the sums are first divided by a count known only then) the caller
gathers after :meth:`GradientBuckets.finish`. With an :attr:`GradientBuckets.ahead`
(:mod:`.sharded_ahead`), each gathered bucket's update is queued behind it.
"""

from __future__ import annotations

from operator import attrgetter, is_
from typing import Any

import torch

from gradhub import codecs
from gradhub.collective import AllReduceParameter, CollectiveFuture, CollectiveGroup
from gradhub.collective.collectives import run_all_gather
from gradhub.collective.sharded_optimizer import Piece, ShardedOptimizer
from gradhub.partition import segment_ranges
from gradhub.train.strategies.replicas import factor
from gradhub.train.strategies.sharded_ahead import StepAhead


class GradientBuckets:
    """Slots of the flat gradient ``grad`` per parameter, filled and launched by bucket."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        grad: torch.Tensor,
        arp: AllReduceParameter,
        group: CollectiveGroup,
        bucket_mb: float,
    ) -> None:
        self._params, self._grad, self._arp, self._group = params, grad, arp, group
        self._buckets: list[tuple[int, int]] = []  # (offset, numel) in the flat vector
        # id(param) -> (its bucket, its slot in grad shaped as the parameter)
        self._slot: dict[int, tuple[int, torch.Tensor]] = {}
        self._sizes: list[int] = []  # parameters per bucket
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        limit = max(1, int(bucket_mb * 1024 * 1024 / 4))
        end, size, count = total, 0, 0
        for i in reversed(range(len(params))):
            n = params[i].numel()
            if count and size + n > limit:
                self._buckets.append((end - size, size))
                self._sizes.append(count)
                end, size, count = end - size, 0, 0
            slot = grad[offsets[i] : offsets[i] + n].view(params[i].shape)
            self._slot[id(params[i])] = (len(self._buckets), slot)
            size, count = size + n, count + 1
        self._buckets.append((end - size, size))
        self._sizes.append(count)
        self._segments = [grad[offset : offset + n] for offset, n in self._buckets]
        self._ready = [0] * len(self._buckets)
        # Per bucket, the gradients taken and their slots: copied at its launch.
        self._taken: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        self._pending: dict[int, tuple[int, torch.Tensor]] = {}  # _slot's, not taken yet
        self._next = 0
        self._scale, self._scale_value = factor(1.0), 1.0
        self._gather = False
        self._gathers: list[CollectiveFuture[torch.Tensor]] = []
        self.ahead: StepAhead | None = None
        """Where each gathered bucket's update is taken during the backward, if anywhere."""

    def begin(self, scale: float, *, gather: bool, live: list[dict[str, Any]]) -> None:
        """A synchronising backward starts: this rank's gradients count ``scale``
        times (``live``: the script's parameter groups, for :attr:`ahead`)."""
        self._ready = [0] * len(self._buckets)
        self._taken = [([], []) for _ in self._buckets]
        self._pending = self._slot.copy()
        self._next = 0
        if scale != self._scale_value:  # one tensor per weight, not one per step
            self._scale, self._scale_value = factor(scale), scale
        self._gather = gather
        self._gathers = []
        if self.ahead is not None:
            self.ahead.begin(live, wanted=gather)

    def ready(self, p: torch.Tensor) -> None:
        """``p.grad`` holds its accumulated gradient: take it, launch full buckets."""
        grad = p.grad
        if grad is not None:
            slot = self._pending.pop(id(p), None)
            if slot is not None and self._take(slot, grad):
                self._launch_ready()

    def finish(self) -> list[bool] | None:
        """Backward ended: take every gradient not taken yet (zeros where no
        ``.grad``), launch. Returns per parameter whether it had a ``.grad``, or
        None where every one had."""
        if not self._pending:
            self._launch_ready()
            return None
        had: list[bool] = []
        zeros: list[torch.Tensor] = []
        for p in self._params:
            slot = self._pending.pop(id(p), None)
            grad = None if slot is None else p.grad
            had.append(slot is None or grad is not None)
            if slot is not None and grad is None:
                zeros.append(slot[1])
                self._ready[slot[0]] += 1
            elif slot is not None and grad is not None:
                self._take(slot, grad)
        if zeros:
            torch._foreach_zero_(zeros)
        self._launch_ready()
        return had

    def wait_gathered(self) -> bool:
        """Whether the buckets were gathered during backward (then wait for the last ones)."""
        for future in self._gathers:
            future.wait()
        return self._gather

    def backward_done(self, all_used: bool) -> None:
        """``.grad`` holds the gathered sums (every parameter used somewhere: ``all_used``)."""
        if self.ahead is not None:
            self.ahead.backward_done(all_used, len(self._buckets))

    def _take(self, where: tuple[int, torch.Tensor], grad: torch.Tensor) -> bool:
        """Note ``grad`` for its bucket's copy into its slot (``where``: the bucket,
        the slot); whether that filled the bucket."""
        b, slot = where
        if grad.data_ptr() != slot.data_ptr():
            grads, slots = self._taken[b]
            grads.append(grad)
            slots.append(slot)
        elif not grad.is_contiguous():  # overlaps its slot without being it
            grads, slots = self._taken[b]
            grads.append(grad.clone())
            slots.append(slot)
        # else .grad is its slot already (the last combined gradient): nothing to copy
        self._ready[b] += 1
        return self._ready[b] == self._sizes[b]

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets):
            b = self._next
            if self._ready[b] < self._sizes[b]:
                return
            offset, n = self._buckets[b]
            segment = self._segments[b]
            grads, slots = self._taken[b]
            if grads:  # one operation per bucket, not one per parameter
                torch._foreach_copy_(slots, grads)  # 16-bit gradients widened exactly
            self._taken[b] = ([], [])
            if self._scale_value != 1.0:  # x * 1 is x: no pass over the bucket then
                segment.mul_(self._scale)  # each element rounded once, as by a fused mul
            self._arp.put_gradient_segment(segment, offset)
            if self._gather:
                self._gathers.append(self._gather_segment(offset, n))
                if self.ahead is not None:
                    self.ahead.bucket(offset, n)
            self._next += 1

    def _gather_segment(self, offset: int, n: int) -> CollectiveFuture[torch.Tensor]:
        """Queue, behind the segment's reduce-scatter, the all-gather of its sums."""
        arp, group = self._arp, self._group
        ranges = segment_ranges(arp.size, group.world_size, offset, n)
        here, length = ranges[group.rank]
        begin = offset + here - arp.local_partition_range[0]
        own = arp.gradient_partition[begin : begin + length]
        codec = arp.gradient_codec
        out = self._grad[offset : offset + n]

        def body() -> Any:
            wire = own if isinstance(codec, codecs.NoCompression) else codec.encode(own)
            return run_all_gather(
                group, wire, n, codec, out=out, name="gradient all_gather", ranges=ranges
            )

        return group.submit("gradient all_gather", body)


_GRAD = attrgetter("grad")


class PieceGradients:
    """Each piece's fp32 gradient (``step_pieces``' argument) from its parameter's
    ``.grad``: where every one is still the combined gradient's view (the usual
    step), one list of slices of it, cut once; else cut per step.

    :meth:`step` steps the pieces with them. Where nothing else steps the slice
    optimizer on some pieces only (no :class:`~.sharded_ahead.StepAhead`), the
    usual step's gradients stay on the pieces from one step to the next instead
    of being set and cleared piece by piece every step (any other step sets
    every piece's, and clears them after)."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        pieces: list[Piece],
        views: list[torch.Tensor],
        combined: bool,
    ) -> None:
        """``views``: per parameter, its view of the gradient vector; ``combined``:
        they are the fp32 sums themselves (else a 16-bit copy, read per step)."""
        self.pieces, self.views = pieces, views
        self._combined = combined
        self._owners = [params[q.index] for q in pieces]
        self._views = [q.view for q in pieces]
        self._their = [views[q.index] for q in pieces]
        self._cuts: list[torch.Tensor | None] = [
            views[q.index].view(-1)[q.offset :][: q.view.numel()] for q in pieces
        ]

    def __call__(self) -> list[torch.Tensor | None]:
        if self._combined and all(map(is_, map(_GRAD, self._owners), self._their)):
            return self._cuts  # read, never changed, by step_pieces
        grads: list[torch.Tensor | None] = []
        for piece, owner, view, cut in zip(
            self.pieces, self._owners, self._their, self._cuts, strict=True
        ):
            grad = owner.grad
            if grad is view and self._combined:
                grad = cut
            elif grad is not None:
                flat = grad.detach().reshape(-1)
                grad = flat[piece.offset : piece.offset + piece.view.numel()].float()
            grads.append(grad)
        return grads

    def step(self, opt: ShardedOptimizer, *, keep: bool) -> None:
        """``opt.step_pieces`` with the pieces' gradients; ``keep``: they may stay
        on the pieces (see the class docstring)."""
        grads = self()
        if not (keep and grads is self._cuts):
            opt.step_pieces(grads)
            return
        if not all(map(is_, map(_GRAD, self._views), grads)):  # another step cleared them
            for view, cut in zip(self._views, grads, strict=True):
                view.grad = cut
        with opt.lock:  # step_pieces' step, less the clearing
            opt.optimizer.step()
            opt.steps += 1
        opt.parameter.send_weight_partition()
