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
- When backward ends, every bucket is waited for and each used parameter's
  ``.grad`` becomes a view of its bucket slot (no copy back; fp32): after
  ``loss.backward()`` the gradients are combined, so clipping them with
  ``torch.nn.utils.clip_grad_norm_`` clips by the global norm.
- Weights: by default ``1 / world_size`` (DDP's mean of the ranks' means,
  bit-identical to DDP). After ``model.set_samples(n, global_n)`` the weight
  is ``n / global_n``: the step equals the single-process step on the global
  batch, exact for uneven batches. With ``set_samples(n)`` alone, the
  gradients are multiplied by ``n`` and the sum divided by the summed count.
  The counts are summed with the used flags (below).
- ``compress=`` picks the bucket reducer (:mod:`gradhub.train.reducers`):
  ``"none"``, ``"fp16"``, ``"bf16"`` (16 bits on the wire, summed in fp32),
  ``"powersgd"``, or one registered there. The built-in ones reduce on the
  job's group's transport (shared memory on one host, the hierarchical path
  across hosts). A reducer with ``launch`` is started from the hooks; one
  with only ``reduce`` runs on one communication thread, buckets in order.

Decisions (DDP's documented behaviour where the issue was silent):
- Gradients are combined as DDP combines them, bit for bit on 2 ranks: each
  rank's gradient times ``1 / world_size`` (``torch.mul`` into the bucket,
  DDP's ``mul_out``), summed. A synchronising backward after another one
  (no step between) combines again what ``.grad`` then holds: the combined
  gradient plus the new local one, as DDP.
- Used flags: one float per parameter, with the sample count, summed in
  host memory by one small all-reduce after the last bucket
  (:mod:`.step_flags`): no step reads a flag or count back from a device,
  so a steady-state step makes no host synchronisation. A parameter no rank
  used keeps its ``.grad`` (``None`` after ``zero_grad``) and the optimizer
  skips it, as DDP ``find_unused_parameters=True``; one used on some ranks
  gets zeros (or its stale ``.grad``) from the others, as DDP.
- Buffers follow rank 0 at forward (:mod:`.forward`); parameters and buffers
  start from rank 0's at set-up.
- ``optimizer.step()`` with no backward since the last step steps the
  script's optimizer on what ``.grad`` holds (the same bits on every rank),
  as DDP would. Any ``torch.optim.Optimizer`` works, custom classes too, and
  several over disjoint parameters: ``prepare(model, [opt_a, opt_b])``
  returns one prepared optimizer per optimizer; step each. A trainable
  parameter in no optimizer is still combined, never moved.
- bf16 and fp16 parameters: buckets stay fp32; a 16-bit gradient is widened
  exactly, multiplied by the weight and summed in fp32, and the sum is
  rounded once (to nearest even) into a 16-bit ``.grad`` (a copy, not a
  view). DDP sums in the parameter dtype, so its bits differ there; the
  result here is the more accurate one. float64 parameters are refused
  (the fp32 buckets would round them).
- ``register_comm_hook(state, hook)`` as DDP's: the bucket then holds raw
  gradients (no division), the hook gets a :class:`~gradhub.train.reducers.GradBucket`
  and the tensor its future returns is the bucket's sum; the used flags and
  sample count go in one small separate all-reduce. ``set_samples`` is
  refused with a hook (the hook does the averaging).
- ``join()``: see :mod:`.join`. A joined rank shadows each step's bucket
  reductions with zero buckets of its own.
- Loss scaling (:class:`gradhub.GradScaler`): every bucket is waited for
  when backward ends, so ``unscale_`` reads reduced gradients, the same bits
  on every rank: the found-inf check is local and agrees by construction. An
  overflow on the wire (``compress="fp16"`` encodes in half without
  saturating: a contribution or a sum beyond its range) arrives as inf and
  counts as found inf. A skipped step calls the reducer's ``step_skipped()``
  where it has one. torch's own ``GradScaler`` works unchanged: a skipped
  ``step`` leaves the next backward to combine again.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch

from gradhub._config import config_or_options
from gradhub.collective import CollectiveFuture
from gradhub.errors import (
    CollectiveTimeoutError,
    InvalidOptionError,
    MisuseError,
    UnsupportedByStrategyError,
)
from gradhub.train import reducers
from gradhub.train.strategies.base import Strategy
from gradhub.train.strategies.replicas import factor
from gradhub.train.strategies.step_flags import StepFlags


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
            raise InvalidOptionError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        reducers.check_name(self.compress)


_WIDTHS = (torch.float32, torch.bfloat16, torch.float16)
"""Parameter dtypes the fp32 buckets hold without rounding a gradient."""


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    offsets: list[int]
    buffer: torch.Tensor
    shapes: list[torch.Size]
    slots: list[torch.Tensor]  # per parameter: its flat slice of the buffer
    views: list[torch.Tensor]  # the same, shaped as the parameter (what .grad becomes)
    ready: int = 0
    work: Any = None
    filled: set[int] = field(default_factory=set)


class _FutureWork:
    """A reduction on the communication thread, waited like a c10d Work; ``wait()``
    gives up after ``limit`` s (its collectives, bounded, name the ranks first)."""

    def __init__(
        self, future: concurrent.futures.Future[None], name: str = "", limit: float | None = None
    ) -> None:
        self._future, self._name, self._limit = future, name, limit

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = self._limit if timeout is None else timeout.total_seconds()
        try:
            self._future.result(timeout=seconds)
        except concurrent.futures.TimeoutError:
            if timeout is None:  # not the group's wait: the thread numbers its operations
                raise CollectiveTimeoutError(
                    self._name, [], self._limit or 0.0, "the reduction did not return"
                ) from None
            return False  # as a c10d Work: CollectiveGroup.wait names whom it waited for
        return True


class _Patient:
    """Waits for a bucket's reduction a little past the group's timeout: the
    reduction started first, so its own error (which names the ranks that did
    not answer) comes first and is the one raised, not the caller's."""

    def __init__(self, work: Any, timeout: float) -> None:
        self._work, self._grace = work, timedelta(seconds=min(5.0, timeout))

    def wait(self, timeout: timedelta | None = None) -> Any:
        """What the work's own ``wait`` returns (``False`` only on a c10d timeout)."""
        if timeout is None:
            return self._work.wait()
        return self._work.wait(timeout + self._grace)


class AllReduceStrategy(Strategy):
    """Bucketed, overlapped all-reduce of gradients; the local optimizer steps."""

    name = "allreduce"
    several_optimizers = True
    supports_join = True
    survives = True

    def __init__(self, config: AllReduceConfig | None = None, **options: Any) -> None:
        super().__init__()
        self.config = config_or_options(AllReduceConfig, config, options)
        self._buckets: list[_Bucket] = []
        self._where: dict[int, tuple[int, int]] = {}  # id(param) -> (bucket, index in bucket)
        self._reducer: Any = None
        self._hook: reducers.CommHook | None = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._scale = factor(0.0)
        self._by_count = False
        self._next_launch = 0
        self._shadowing = False  # a joined rank's zero contribution
        self._divisor = factor(1.0)
        self._index: dict[int, int] = {}  # id(param) -> position in self.params
        self._flags: StepFlags | None = None
        self._flags_work: Any = None

    # set-up ------------------------------------------------------------------------

    def _setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        odd = sorted({str(p.dtype) for p in self.params if p.dtype not in _WIDTHS})
        if odd:
            raise InvalidOptionError(
                f"strategy 'allreduce' sums gradients in fp32 buckets; parameters of "
                f"dtype {', '.join(odd)} would be rounded\n- help: call model.float() "
                "(or .bfloat16()) before gradhub.prepare"
            )
        if self.runtime.survive and self.config.compress != "none":
            raise UnsupportedByStrategyError(
                f"compress={self.config.compress!r} under `gradhub run --survive`: a "
                "compressing reducer's state (error feedback) is per rank and would be lost "
                "with a dead one\n- help: compress='none', or drop --survive"
            )
        self._broadcast_from_rank0(model)
        self._rebind()
        if not hasattr(self._reducer, "launch"):
            self._thread = concurrent.futures.ThreadPoolExecutor(1, "gradhub-reduce")
        self._build_buckets(self.params)
        self._index = {id(p): k for k, p in enumerate(self.params)}

    def _rebind(self) -> None:
        options = dict(self.config.compress_options)
        # The job's group: the built-in reducers use its transport (shm on one host).
        collective = options.pop("collective", self.runtime.group)
        self._reducer = reducers.make(self.config.compress, collective=collective, **options)
        self._flags = StepFlags(len(self.params), self.runtime.group)

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
            buffer = torch.zeros(total, dtype=torch.float32, device=device)
            slots = [buffer[o : o + p.numel()] for o, p in zip(offsets, group, strict=True)]
            views = [s.view_as(p) for s, p in zip(slots, group, strict=True)]
            shapes = [p.shape for p in group]
            self._buckets.append(_Bucket(group, offsets, buffer, shapes, slots, views))

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """DDP's ``register_comm_hook`` (see the module docstring); once, before training."""
        if self._hook is not None:
            raise MisuseError("register_comm_hook can only be called once, as DDP's")
        if self.runtime.survive:
            raise UnsupportedByStrategyError(
                "register_comm_hook under `gradhub run --survive`: a hook's state holds the "
                "process group, which is rebuilt over the survivors after a death\n"
                "- help: drop the hook, or drop --survive"
            )
        if self.steps or self._synced or self._samples is not None:
            raise MisuseError(
                "register_comm_hook after training started or with set_samples\n- help: "
                "register it right after gradhub.prepare; the hook does the averaging"
            )
        self._hook = reducers.CommHook(state, hook)

    def set_samples(self, samples: int, global_samples: int | None = None) -> None:
        if self._hook is not None:
            raise MisuseError(
                "set_samples with a comm hook: the hook decides how ranks are weighted\n"
                "- help: weight inside the hook, or drop register_comm_hook"
            )
        super().set_samples(samples, global_samples)

    # one synchronising backward ------------------------------------------------------

    def _begin_sync(self) -> None:
        for bucket in self._buckets:
            bucket.ready, bucket.work = 0, None
            bucket.filled.clear()
        scale, self._by_count = self._weights()
        self._scale = factor(scale)
        self._divisor = factor(self.world_size if self._join is None else self._join.divisor)
        self._next_launch = 0

    def _grad_ready(self, p: torch.Tensor) -> None:
        if p.grad is None or not self.config.overlap:
            return
        b, i = self._where[id(p)]
        if i not in self._buckets[b].filled:
            self._fill(self._buckets[b], i, p.grad)
            self._launch_ready()

    def _fill(self, bucket: _Bucket, i: int, grad: torch.Tensor | None) -> None:
        slot = bucket.slots[i]
        if grad is None or self._shadowing:
            slot.zero_()
        elif _aliases(grad, slot):
            as_view = self.ddp.gradient_as_bucket_view and self._samples is None
            if self._hook is None and as_view:
                slot.div_(self._divisor)  # DDP divides a bucket-view .grad in place
            elif self._hook is None:
                slot.mul_(self._scale)
        elif self._hook is not None:
            slot.copy_(grad.reshape(-1))  # a comm hook does its own averaging
        elif grad.dtype == torch.float32:
            torch.mul(grad, self._scale, out=bucket.views[i])  # DDP's mul_out
        else:
            slot.copy_(grad.reshape(-1))  # 16-bit: widened exactly, scaled in fp32
            slot.mul_(self._scale)
        bucket.filled.add(i)
        bucket.ready += 1

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets):
            index = self._next_launch
            bucket = self._buckets[index]
            if bucket.ready < len(bucket.params):
                return
            last = index == len(self._buckets) - 1
            if last:  # every hook of this backward has run: the flags are complete
                self._write_flags()
            bucket.work = self._launch(bucket, index, last)
            self._next_launch += 1
            if last and self._hook is None:  # a comm hook's work sums them after its own
                self._flags_work = self._launch_flags()

    def _write_flags(self) -> None:
        assert self._flags is not None
        if self._shadowing:
            self._flags.write_zeros()
            return
        samples = self._samples[0] if self._samples is not None else 1
        self._flags.write([id(p) in self._used for p in self.params], samples, self._joining())

    def _launch_flags(self) -> Any:
        flags = self._flags
        assert flags is not None
        if self._thread is None or self.world_size == 1:
            return flags.launch()

        def reduce_flags() -> None:
            flags.launch().wait()

        # After the reducer's own collectives, on its thread: the same order on every rank.
        return self._on_thread(reduce_flags)

    def _launch(self, bucket: _Bucket, index: int, last: bool) -> Any:
        if self._hook is not None:
            assert self._flags is not None
            grads = reducers.GradBucket(index, bucket.buffer, bucket.params, bucket.offsets, last)
            return self._hook.launch(grads, self._flags.tensor if last else None)
        kw = {"shapes": bucket.shapes, "bucket_index": index, "step": self.steps}
        if self._thread is None:
            return self._reducer.launch(bucket.buffer, **kw)
        reduce = self._reducer.reduce
        return self._on_thread(lambda: reduce(bucket.buffer, **kw))

    def _on_thread(self, fn: Callable[[], None]) -> _FutureWork:
        """``fn`` on the communication thread; waited by itself (see :class:`_FutureWork`)."""
        assert self._thread is not None
        name = f"all_reduce at step {self.steps} of strategy {self.name!r}"
        grace = min(5.0, self.runtime.timeout)
        return _FutureWork(self._thread.submit(fn), name, self.runtime.timeout + grace)

    def _finish_backward(self) -> None:
        for bucket in self._buckets:
            for i, p in enumerate(bucket.params if bucket.ready < len(bucket.params) else ()):
                if i not in bucket.filled:
                    grad = p.grad
                    if grad is not None and id(p) not in self._used and not self._shadowing:
                        # Unused here: keep its .grad off the bucket, in case no rank used it.
                        grad = p.grad = grad.clone()
                    self._fill(bucket, i, grad)
        self._launch_ready()
        for bucket in self._buckets:
            self._await(bucket.work)
        assert self._flags is not None
        work, self._flags_work = self._flags_work, None
        if work is not None:
            self._await(work)
        if self._shadowing:
            return
        used, total = self._flags.read()
        self._regroup_after = self.runtime.survive and self._flags.regroup()
        if total <= 0 and self._samples is not None:
            raise InvalidOptionError("no rank processed any sample in this step")
        fix = None
        if self._by_count:
            fix = 1.0 / total
        elif self._samples is not None and self._samples[1] is not None:
            # Ranks scaled by samples / global_samples; if their global counts did
            # not match the samples actually processed, correct to the true weights.
            expected = float(self._samples[1])
            fix = expected / total if total != expected else None
        index, every = self._index, bool(used.all())
        for bucket in self._buckets:
            if fix is not None:
                bucket.buffer.mul_(fix)
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if not every and not used[index[id(p)]]:
                    continue  # no rank used it: .grad stays as it was (DDP)
                if p.dtype != torch.float32:
                    p.grad = view.to(p.dtype)
                elif p.grad is not view:
                    p.grad = view

    def _await(self, work: Any) -> None:
        if isinstance(work, _SELF_BOUNDED):
            work.wait()  # bounded by its own deadline (see each); its error names the ranks
        else:  # a c10d Work or a reducer's handle: the runtime's bounded wait
            self._wait(_Patient(work, self.runtime.timeout), "all_reduce")

    def _shadow_sync(self) -> None:
        for p in self.params:  # a joined rank's own gradients stay as they are (DDP)
            b, i = self._where[id(p)]
            if p.grad is not None and _aliases(p.grad, self._buckets[b].slots[i]):
                p.grad = p.grad.clone()
        self._shadowing = True
        try:
            self._begin_sync()
            self._finish_backward()
        finally:
            self._shadowing = False

    def _apply(self) -> None:
        self._step_optimizer(self._current)

    def _apply_unsynced(self) -> None:
        self._step_optimizer(self._current)  # DDP: step on what .grad holds

    def _skip(self) -> None:
        skipped = getattr(self._reducer, "step_skipped", None)
        if skipped is not None:  # e.g. PowerSGD's error feedback holds this step's inf
            skipped()

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
        super().close()


_SELF_BOUNDED = (CollectiveFuture, _FutureWork, reducers.StreamWork, reducers.Ready)
"""Handles whose ``wait`` has its own bound and names whom it waited for."""


def _aliases(grad: torch.Tensor, slot: torch.Tensor) -> bool:
    """Whether ``grad`` is the bucket slot itself (a ``.grad`` left as a view)."""
    return grad.data_ptr() == slot.data_ptr()
