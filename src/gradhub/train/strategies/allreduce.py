"""``allreduce``: synchronous data parallelism, every rank steps its own optimizer.

The user's optimizer runs on every rank over gradients that are the same bits
everywhere, so the replicas stay equal. Gradients are combined during
backward, as DDP does:

- Gradients go into flat fp32 buckets of about ``bucket_mb`` megabytes, filled
  in the order backward produces them (parameters in reverse registration
  order). A post-accumulate-grad hook per parameter writes its gradient,
  multiplied by this rank's weight, into its bucket slot; when a bucket is
  full its reduction starts at once, so communication overlaps the rest of
  backward. Buckets start strictly in index order on every rank, so the
  collectives always match even if backward order differs between ranks.
- When backward ends, every bucket is waited for and each parameter's
  ``.grad`` becomes a view of its bucket slot (no copy back): after
  ``loss.backward()`` the gradients are combined, so clipping them with
  ``torch.nn.utils.clip_grad_norm_`` clips by the global norm.
- Weights: by default ``1 / world_size`` (DDP's mean of the ranks' means,
  bit-identical to DDP). After ``model.set_samples(n, global_n)`` the weight
  is ``n / global_n``: the step equals the single-process step on the global
  batch, exact for uneven batches. With ``set_samples(n)`` alone, the
  gradients are multiplied by ``n`` and the sum divided by the summed count.
  The count rides as one extra element of bucket 0 (no extra collective).
- ``compress=`` picks the bucket reducer (:mod:`gradhub.train.reducers`):
  ``"none"``, ``"fp16"``, ``"bf16"`` (16 bits on the wire, summed in fp32),
  ``"powersgd"``, or one registered there. The built-in ones reduce on the
  job's group's transport (shared memory on one host, the hierarchical path
  across hosts). A reducer with ``launch`` is started from the hooks; one
  with only ``reduce`` runs on one communication thread, buckets in order.

Decisions:
- A parameter that received no gradient on a rank contributes zeros from that
  rank; it is updated like every other parameter (with the combined gradient,
  zero if no rank used it).
- Buffers (e.g. batch-norm statistics) are broadcast from rank 0 at set-up,
  not on every step.
- Loss scaling (:class:`gradhub.GradScaler`): every bucket is waited for
  when backward ends, so ``unscale_`` reads reduced gradients, the same bits
  on every rank: the found-inf check is local and agrees by construction. An
  overflow on the wire (``compress="fp16"`` encodes in half without
  saturating: a contribution or a sum beyond its range) arrives as inf and
  counts as found inf. A skipped step calls the reducer's ``step_skipped()``
  where it has one.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from gradhub._config import config_or_options
from gradhub.train import reducers
from gradhub.train.strategies.base import Strategy


@dataclass(kw_only=True)
class AllReduceConfig:
    """Settings of the ``allreduce`` strategy."""

    bucket_mb: float = 25.0
    """Target bucket size in megabytes (fp32): fewer, larger messages vs. earlier overlap."""
    overlap: bool = True
    """Start each bucket's reduction from backward hooks as soon as it is full."""
    compress: str = "none"
    """Bucket reducer: ``"none"``, ``"fp16"``, ``"bf16"`` or one registered in
    :mod:`gradhub.train.reducers`; every rank ends with the same bits."""
    compress_options: dict[str, Any] = field(default_factory=dict)
    """Keyword options of the reducer (e.g. PowerSGD's ``rank``)."""

    def __post_init__(self) -> None:
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        reducers.check_name(self.compress)


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    shapes: list[torch.Size]
    ready: int = 0
    work: Any = None
    filled: set[int] = field(default_factory=set)


class _FutureWork:
    """A reduction running on the communication thread, waited like a c10d Work."""

    def __init__(self, future: concurrent.futures.Future[None]) -> None:
        self._future = future

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        try:
            self._future.result(timeout=seconds)
        except concurrent.futures.TimeoutError:
            return False  # as a c10d Work: CollectiveGroup.wait names whom it waited for
        return True


class AllReduceStrategy(Strategy):
    """Bucketed, overlapped all-reduce of gradients; the local optimizer steps."""

    name = "allreduce"

    def __init__(self, config: AllReduceConfig | None = None, **options: Any) -> None:
        super().__init__()
        self.config = config_or_options(AllReduceConfig, config, options)
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, index in bucket)
        self._reducer: Any = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._scale = 0.0
        self._by_count = False
        self._next_launch = 0

    # set-up ------------------------------------------------------------------------

    def _setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._broadcast_from_rank0(model)
        options = dict(self.config.compress_options)
        # The job's group: the built-in reducers use its transport (shm on one host).
        collective = options.pop("collective", self.runtime.group)
        self._reducer = reducers.make(self.config.compress, collective=collective, **options)
        if not hasattr(self._reducer, "launch"):
            self._thread = concurrent.futures.ThreadPoolExecutor(1, "gradhub-reduce")
        self._build_buckets(self.params)

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
            self._buckets.append(_Bucket(group, offsets, buffer, [p.shape for p in group]))

    # one synchronising backward ------------------------------------------------------

    def _begin_sync(self) -> None:
        for bucket in self._buckets:
            bucket.ready, bucket.work = 0, None
            bucket.filled.clear()
        self._scale, self._by_count = self._weights()
        samples = self._samples[0] if self._samples is not None else 1
        self._buckets[0].buffer[-1] = float(samples)
        self._next_launch = 0

    def _grad_ready(self, p: torch.Tensor) -> None:
        if p.grad is None or not self.config.overlap:
            return
        b, i = self._where[id(p)]
        bucket = self._buckets[b]
        if i in bucket.filled:
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
            bucket.work = self._launch(bucket, self._next_launch)
            self._next_launch += 1

    def _launch(self, bucket: _Bucket, index: int) -> Any:
        kw = {"shapes": bucket.shapes, "bucket_index": index, "step": self.steps}
        if self._thread is None:
            return self._reducer.launch(bucket.buffer, **kw)
        reduce = self._reducer.reduce
        return _FutureWork(self._thread.submit(lambda: reduce(bucket.buffer, **kw)))

    def _finish_backward(self) -> None:
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params):
                if i not in bucket.filled:
                    self._fill(bucket, i, p.grad)
        self._launch_ready()
        first = self._buckets[0]
        self._wait(first.work, "all_reduce")
        total = float(first.buffer[-1])
        if total <= 0 and self._samples is not None:
            raise ValueError("no rank processed any sample in this step")
        fix = None
        if self._by_count:
            fix = 1.0 / total
        elif self._samples is not None and self._samples[1] is not None:
            # Ranks scaled by samples / global_samples; if their global counts did
            # not match the samples actually processed, correct to the true weights.
            expected = float(self._samples[1])
            fix = expected / total if total != expected else None
        for bucket in self._buckets:
            if bucket is not first:
                self._wait(bucket.work, "all_reduce")
            if fix is not None:
                bucket.buffer.mul_(fix)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                p.grad = bucket.buffer[offset : offset + p.numel()].view_as(p)

    def _apply(self) -> None:
        assert self.optimizer is not None
        self.optimizer.step()

    def _skip(self) -> None:
        skipped = getattr(self._reducer, "step_skipped", None)
        if skipped is not None:  # e.g. PowerSGD's error feedback holds this step's inf
            skipped()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
        super().close()
