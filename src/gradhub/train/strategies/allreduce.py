"""``allreduce``: synchronous data parallelism, gradients weighted by samples.

Each rank scales its mean-loss gradient by its share of the global batch
(``samples / global_samples``) and the ranks all-reduce (sum) those, together
with the sample counts: the result is the gradient of the mean loss over the
whole global batch, exact for uneven per-rank batches (averaging by world
size, as DDP does, is not). The summed sample count checks the weights; if
the ranks' ``global_samples`` disagreed with it, the sum is rescaled to the
true count, so the result is always sum(n_i * g_i) / sum(n_i).

Speed:
- Gradients go into flat buckets of about ``bucket_mb`` megabytes, filled in
  the order backward produces them (parameters in reverse registration order).
- A post-accumulate-grad hook per parameter writes its scaled gradient into
  its bucket slot; when a bucket is full its asynchronous ``all_reduce`` is
  launched at once, so communication overlaps the rest of backward.
- Buckets are launched strictly in index order on every rank, so collectives
  always match even if backward order differs between ranks.
- The sample count rides as one extra element in the first bucket: no extra
  collective. Scaling happens while copying into the bucket, so no pass over
  the gradients is left after the reduction, and each parameter's ``.grad``
  then *is* a view of its bucket slot (no copy back).

Decisions:
- A parameter that received no gradient on a rank contributes zeros from that
  rank; it is updated like every other parameter (with the averaged gradient,
  zero if no rank used it).
- Buffers (e.g. batch-norm statistics) are broadcast from rank 0 at set-up,
  not on every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradhub.train.strategies.base import Closure, Strategy


@dataclass(kw_only=True)
class AllReduceConfig:
    """Settings of the ``allreduce`` strategy."""

    bucket_mb: float = 25.0
    """Target bucket size in megabytes (fp32): fewer, larger messages vs. earlier overlap."""
    overlap: bool = True
    """Launch each bucket's all-reduce from backward hooks as soon as it is full."""

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    ready: int = 0
    work: Any = None
    filled: set[int] = field(default_factory=set)


class AllReduceStrategy(Strategy):
    """Bucketed, overlapped, sample-weighted all-reduce of gradients."""

    name = "allreduce"

    def __init__(self, config: AllReduceConfig | None = None, **options: Any) -> None:
        super().__init__()
        if config is not None and options:
            raise TypeError("pass either config= or keyword options, not both")
        self.config = config or AllReduceConfig(**options)
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, index in bucket)
        self._hooks: list[Any] = []
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scale = 0.0
        self._expected = 0.0
        self._armed = False
        self._next_launch = 0

    # set-up ------------------------------------------------------------------------

    def _setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None:
            raise ValueError("strategy 'allreduce' needs a local optimizer (torch.optim)")
        self._model, self._optimizer = model, optimizer
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no parameters that require gradients")
        self._broadcast_from_rank0(model)
        self._build_buckets(params)
        if self.config.overlap:
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _build_buckets(self, params: list[torch.nn.Parameter]) -> None:
        limit = max(1, int(self.config.bucket_mb * 1024 * 1024 / 4))
        groups: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in reversed(params):  # backward produces gradients roughly in reverse
            if groups[-1] and size + p.numel() > limit:
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += p.numel()
        device = params[0].device
        for b, group in enumerate(groups):
            offsets, total = [], 0
            for i, p in enumerate(group):
                offsets.append(total)
                total += p.numel()
                self._where[id(p)] = (b, i)
            extra = 1 if b == 0 else 0  # bucket 0 carries the sample count
            buffer = torch.zeros(total + extra, dtype=torch.float32, device=device)
            self._buckets.append(_Bucket(group, offsets, buffer))

    # one step ----------------------------------------------------------------------

    def step(self, closure: Closure, samples: int, global_samples: int) -> None:
        self._check_counts(samples, global_samples)
        assert self._model is not None and self._optimizer is not None
        self._optimizer.zero_grad(set_to_none=True)
        for bucket in self._buckets:
            bucket.ready, bucket.work = 0, None
            bucket.filled.clear()
        self._buckets[0].buffer[-1] = float(samples)
        self._scale = samples / global_samples
        self._expected = float(global_samples)
        self._next_launch = 0
        self._armed = True
        try:
            if samples > 0:
                closure().backward()
            self._finish()
        finally:
            self._armed = False
        self._optimizer.step()
        self.steps += 1

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._armed or p.grad is None:
            return
        b, i = self._where[id(p)]
        bucket = self._buckets[b]
        if i in bucket.filled:  # a second backward in one step: not supported, keep first
            return
        self._fill(bucket, i, p.grad)
        self._launch_ready()

    def _fill(self, bucket: _Bucket, i: int, grad: torch.Tensor | None) -> None:
        p, offset = bucket.params[i], bucket.offsets[i]
        slot = bucket.buffer[offset : offset + p.numel()]
        if grad is None:
            slot.zero_()
        else:
            torch.mul(grad.reshape(-1), self._scale, out=slot)
        bucket.filled.add(i)
        bucket.ready += 1

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                return
            bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
            self._next_launch += 1

    def _finish(self) -> None:
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params):
                if i not in bucket.filled:
                    self._fill(bucket, i, p.grad)
        self._launch_ready()
        first = self._buckets[0]
        self._wait(first.work, "all_reduce")
        total = float(first.buffer[-1])
        if total <= 0:  # every rank had an empty batch: nothing to learn from
            raise ValueError("no rank processed any sample in this step")
        # Ranks scaled by samples / global_samples; if their global_samples did
        # not match the samples actually processed, correct to the true weights.
        fix = self._expected / total if total != self._expected else None
        for bucket in self._buckets:
            if bucket is not first:
                self._wait(bucket.work, "all_reduce")
            if fix is not None:
                bucket.buffer.mul_(fix)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                p.grad = bucket.buffer[offset : offset + p.numel()].view_as(p)

    # checkpoints and lifecycle -----------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        assert self._optimizer is not None
        return {**super().state_dict(), "optimizer": self._optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        assert self._optimizer is not None
        self._optimizer.load_state_dict(state["optimizer"])

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        super().close()
