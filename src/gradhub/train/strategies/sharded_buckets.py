"""The gradient buckets of ``sharded``: reduce-scattered, then gathered, during backward.

The flat gradient vector (the parameters' order) is cut into buckets of
about ``bucket_mb`` megabytes, last parameters first (backward's order).
Each parameter's accumulated ``.grad``, times this rank's weight, is written
into its slot as its hook fires; a full bucket's reduce-scatter starts at
once on the group's worker, buckets strictly in the same order on every
rank (:meth:`~gradhub.collective.AllReduceParameter.put_gradient_segment`).

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

from typing import Any

import torch

from gradhub import codecs
from gradhub.collective import AllReduceParameter, CollectiveFuture, CollectiveGroup
from gradhub.collective.collectives import run_all_gather
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
        # id(param) -> (bucket, its slot in grad, the slot shaped as the parameter)
        self._slot: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
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
            slot = grad[offsets[i] : offsets[i] + n]
            self._slot[id(params[i])] = (len(self._buckets), slot, slot.view(params[i].shape))
            size, count = size + n, count + 1
        self._buckets.append((end - size, size))
        self._sizes.append(count)
        self._ready = [0] * len(self._buckets)
        self._filled: set[int] = set()
        self._next = 0
        self._scale = factor(1.0)
        self._gather = False
        self._gathers: list[CollectiveFuture[torch.Tensor]] = []
        self.ahead: StepAhead | None = None
        """Where each gathered bucket's update is taken during the backward, if anywhere."""

    def begin(self, scale: float, *, gather: bool, live: list[dict[str, Any]]) -> None:
        """A synchronising backward starts: this rank's gradients count ``scale``
        times (``live``: the script's parameter groups, for :attr:`ahead`)."""
        self._ready = [0] * len(self._buckets)
        self._filled.clear()
        self._next = 0
        self._scale, self._gather = factor(scale), gather
        self._gathers = []
        if self.ahead is not None:
            self.ahead.begin(live, wanted=gather)

    def ready(self, p: torch.Tensor) -> None:
        """``p.grad`` holds its accumulated gradient: fill its slot, launch full buckets."""
        if p.grad is not None and id(p) not in self._filled:
            self._fill(p)
            self._launch_ready()

    def finish(self) -> None:
        """Backward ended: fill every slot not filled yet (zeros where no ``.grad``), launch."""
        for p in self._params:
            if id(p) not in self._filled:
                self._fill(p)
        self._launch_ready()

    def wait_gathered(self) -> bool:
        """Whether the buckets were gathered during backward (then wait for the last ones)."""
        for future in self._gathers:
            future.wait()
        return self._gather

    def backward_done(self, all_used: bool) -> None:
        """``.grad`` holds the gathered sums (every parameter used somewhere: ``all_used``)."""
        if self.ahead is not None:
            self.ahead.backward_done(all_used, len(self._buckets))

    def _fill(self, p: torch.Tensor) -> None:
        b, slot, shaped = self._slot[id(p)]
        grad = p.grad
        if grad is None:
            slot.zero_()
        elif grad.data_ptr() == slot.data_ptr() and grad.is_contiguous():
            slot.mul_(self._scale)  # .grad is already this view (the last combined gradient)
        elif grad.dtype == torch.float32:
            torch.mul(grad, self._scale, out=shaped)
        else:  # 16-bit parameters: weighted and summed in fp32
            slot.copy_(grad.reshape(-1)).mul_(self._scale)
        self._filled.add(id(p))
        self._ready[b] += 1

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets):
            b = self._next
            if self._ready[b] < self._sizes[b]:
                return
            offset, n = self._buckets[b]
            self._arp.put_gradient_segment(self._grad[offset : offset + n], offset)
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
