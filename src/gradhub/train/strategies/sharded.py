"""``sharded``: synchronous training on AllReduceParameter, optimizer state sharded.

BigDL's scheme with ZeRO-1's memory saving. The model's parameters become
views of one flat fp32 vector, laid out group by group in the order of the
optimizer's parameter groups; rank r of P owns slice r of it. Per step
(the prepared optimizer's ``step``):

1. the flat gradient, each rank's multiplied by its weight (see
   :mod:`.base`), is reduce-scattered (optionally compressed on the wire:
   ``compress="bf16"`` etc.) so each rank holds the sum of its own slice.
   As under ``allreduce``, this starts during backward: the flat gradient is
   cut into buckets of about ``bucket_mb`` megabytes, in the order backward
   produces the gradients (the last parameters first), and a post-accumulate
   hook writes each gradient into its bucket; a full bucket's reduce-scatter
   is started at once on the group's communication thread
   (:meth:`~gradhub.collective.AllReduceParameter.put_gradient_segment`),
   buckets strictly in the same order on every rank. Without compression the
   sums are the same bits as one reduce-scatter of the whole vector;
2. the owner steps the slice optimizer on its slice only, so momentum or
   Adam state exists once across the job instead of once per rank;
3. the updated slices are all-gathered straight into the flat vector the
   parameters view.

Decisions:
- The script's optimizer is described by an :class:`~gradhub.optim.OptimizerSpec`
  (its class and every group's hyperparameters); the slice optimizer has one
  group per group of the script's (the part of it this rank owns). Before
  every step the live hyperparameters of the script's groups (what an LR
  scheduler or the user set) are copied onto the slice optimizer's groups.
  The script's optimizer itself is never stepped and keeps no state.
- ``clip_grad_norm_`` reduce-scatters at once, computes the global norm from
  the slices (one scalar all-reduce) and scales the slice; ``step`` then
  goes on from there.
- The optimizer's ``state_dict()`` is the full, unsharded state in the
  single-process optimizer's format (one all-reduce per state tensor; a
  collective: call it on every rank); ``load_state_dict`` takes such a dict
  from a job of any world size or a plain optimizer, and keeps this rank's part.
- Model buffers are broadcast from rank 0 at set-up, not per step.
- Loss scaling (:class:`gradhub.GradScaler`): ``unscale_`` waits for the
  reduce-scatter, unscales this rank's slice of the sum and all-reduces the
  found-inf flag over the group, so every rank skips the same steps. The
  ``"fp16"`` wire codec saturates at +-65504; with loss scaling on, the
  gradients travel in a non-saturating fp16 instead (an overflow on the
  wire, of one rank's value or of a partial sum, becomes inf), so a scaled
  gradient too large for the wire counts as found inf and is never applied
  as a clipped value. The weights' wire keeps the saturating codec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradhub import codecs
from gradhub._config import config_or_options
from gradhub.collective import AllReduceParameter, ShardedOptimizer
from gradhub.errors import MisuseError
from gradhub.optim import OptimizerSpec
from gradhub.train.strategies.base import Strategy, unscale_tensors


@dataclass(kw_only=True)
class ShardedConfig:
    """Settings of the ``sharded`` strategy."""

    compress: str = "none"
    """Wire codec for gradients and weights: ``"none"``, ``"fp16"``, ``"bf16"``,
    ``"bf16-truncate"``; arithmetic and master weights stay fp32."""
    bucket_mb: float = 25.0
    """Gradient bucket size in megabytes (fp32): fewer, larger messages vs. earlier overlap."""
    overlap: bool = True
    """Start each bucket's reduce-scatter from backward hooks as soon as it is full."""

    def __post_init__(self) -> None:
        codecs.check(self.compress, for_="sharded")  # an error now, not mid-job
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")


class ShardedStrategy(Strategy):
    """Reduce-scatter, owner-side optimizer step (ZeRO-1), all-gather."""

    name = "sharded"

    def __init__(self, config: ShardedConfig | None = None, **options: Any) -> None:
        super().__init__()
        self.config = config_or_options(ShardedConfig, config, options)
        self._groups: list[list[torch.nn.Parameter]] = []
        self._flat = torch.zeros(0)
        self._grad = torch.zeros(0)
        self._arp: AllReduceParameter | None = None
        self._opt: ShardedOptimizer | None = None
        self._reduced: torch.Tensor | None = None
        # buckets: (offset, numel) in the flat vector; per parameter: (bucket, offset)
        self._buckets: list[tuple[int, int]] = []
        self._slot: dict[int, tuple[int, int]] = {}
        self._sizes: list[int] = []  # parameters per bucket
        self._ready: list[int] = []
        self._filled: set[int] = set()
        self._next_launch = 0
        self._scale, self._by_count = 1.0, False

    def _setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        assert optimizer is not None
        spec = OptimizerSpec.of(optimizer)  # a custom class is a clear error here
        if any(p.dtype != torch.float32 for p in self.params):
            raise ValueError("strategy 'sharded' trains fp32 parameters; call model.float()")
        trainable = {id(p) for p in self.params}
        self._groups = [
            [p for p in g["params"] if id(p) in trainable] for g in optimizer.param_groups
        ]
        self.params = [p for g in self._groups for p in g]  # the flat vector's order
        self._broadcast_from_rank0(model)
        device = self.params[0].device
        size = sum(p.numel() for p in self.params)
        self._flat = torch.cat([p.detach().reshape(-1) for p in self.params]).to(device)
        self._grad = torch.zeros_like(self._flat)
        offset = 0
        for p in self.params:  # parameters become views of the flat vector
            p.data = self._flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self._arp = AllReduceParameter(
            size, group=self.runtime.group, compress=self.config.compress
        )
        self._arp.init(self._flat)
        sizes = [sum(p.numel() for p in g) for g in self._groups]
        self._opt = ShardedOptimizer(self._arp, spec, group_sizes=sizes)
        self._build_buckets()

    def _build_buckets(self) -> None:
        """Cut the flat vector into buckets, last parameters first (backward's order)."""
        offsets, total = [], 0
        for p in self.params:
            offsets.append(total)
            total += p.numel()
        limit = max(1, int(self.config.bucket_mb * 1024 * 1024 / 4))
        end, size, count = total, 0, 0
        for i in reversed(range(len(self.params))):
            n = self.params[i].numel()
            if count and size + n > limit:
                self._buckets.append((end - size, size))
                self._sizes.append(count)
                end, size, count = end - size, 0, 0
            self._slot[id(self.params[i])] = (len(self._buckets), offsets[i])
            size, count = size + n, count + 1
        self._buckets.append((end - size, size))
        self._sizes.append(count)
        self._ready = [0] * len(self._buckets)

    # one synchronising backward ------------------------------------------------------

    def _begin_sync(self) -> None:
        self._ready = [0] * len(self._buckets)
        self._filled.clear()
        self._next_launch = 0
        self._scale, self._by_count = self._weights()

    def _grad_ready(self, p: torch.Tensor) -> None:
        if self.config.overlap and p.grad is not None and id(p) not in self._filled:
            self._fill(p)
            self._launch_ready()

    def _fill(self, p: torch.Tensor) -> None:
        b, offset = self._slot[id(p)]
        slot = self._grad[offset : offset + p.numel()]
        if p.grad is None:
            slot.zero_()
        else:
            torch.mul(p.grad.reshape(-1), self._scale, out=slot)
        self._filled.add(id(p))
        self._ready[b] += 1

    def _launch_ready(self) -> None:
        assert self._arp is not None
        while self._next_launch < len(self._buckets):
            b = self._next_launch
            if self._ready[b] < self._sizes[b]:
                return
            offset, n = self._buckets[b]
            self._arp.put_gradient_segment(self._grad[offset : offset + n], offset)
            self._next_launch += 1

    def _finish_backward(self) -> None:
        for p in self.params:
            if id(p) not in self._filled:
                self._fill(p)
        self._launch_ready()

    def _reduce(self) -> torch.Tensor:
        """Wait for this step's reduce-scatters; this rank's slice of the sum."""
        if self._reduced is not None:
            return self._reduced
        assert self._arp is not None
        if not self._synced:
            raise MisuseError(
                "the gradients are not combined yet: clip or step after the backward() "
                "outside no_sync() (the last micro-batch's)"
            )
        reduced = self._arp.aggregate_gradient_partition()
        if self._by_count:  # after the waits: no collective beside the segments' own
            assert self._samples is not None
            count = torch.tensor([float(self._samples[0])])
            reduced.div_(float(self.runtime.all_reduce_sum(count, where="sample count")[0]))
        self._reduced = reduced
        return reduced

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        grad = self._reduce()
        if math.isinf(norm_type):
            local = grad.abs().max() if grad.numel() else torch.zeros(())
            total = local.reshape(1).to(torch.float32)
            if self.world_size > 1:
                self._wait(dist.all_reduce(total, op=dist.ReduceOp.MAX, async_op=True), "norm")
            norm = total[0]
        else:
            power = grad.abs().pow(norm_type).sum().reshape(1)
            norm = self.runtime.all_reduce_sum(power, where="gradient norm")[0] ** (1 / norm_type)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grad.mul_(coef)
        return norm

    def use_loss_scaling(self) -> None:
        assert self._arp is not None
        if isinstance(self._arp.gradient_codec, codecs.FP16):
            self._arp.gradient_codec = codecs.FP16(saturate=False)

    def _unscale(self, inv_scale: float) -> bool:
        return self._agree(unscale_tensors([self._reduce()], inv_scale))

    def _skip(self) -> None:
        self._reduce()  # every segment waited for, even if nobody unscaled
        self._reduced = None

    def _apply(self) -> None:
        assert self._arp is not None and self._opt is not None and self.optimizer is not None
        grad = self._reduce()
        for mine, live in zip(self._opt.param_groups, self.optimizer.param_groups, strict=True):
            mine.update({k: v for k, v in live.items() if k != "params"})
        try:
            self._opt.apply(grad)
        finally:
            self._reduced = None
        self._arp.get_weights(self._flat).wait()

    # the full optimizer state ------------------------------------------------------

    def optimizer_state_dict(self) -> dict[str, Any]:
        assert self._opt is not None and self.optimizer is not None
        state: dict[int, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        index = 0
        for g, (params, live) in enumerate(
            zip(self._groups, self.optimizer.param_groups, strict=True)
        ):
            shard = self._opt.optimizer.state.get(self._opt.views[g], {})
            start, end = self._opt.ranges[g]
            a, b = self._opt.owned(g)
            whole: dict[str, Any] = {}
            for key in sorted(shard):
                value = shard[key]
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    full = torch.zeros(end - start, dtype=value.dtype, device=value.device)
                    full[a:b] = value.reshape(-1)
                    whole[key] = self.runtime.all_reduce_sum(full, where="optimizer state")
                else:
                    whole[key] = value
            ids = []
            offset = 0
            for p in params:
                if whole:
                    state[index] = {
                        k: v[offset : offset + p.numel()].view_as(p).clone()
                        if isinstance(v, torch.Tensor) and v.dim() > 0
                        else (v.clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in whole.items()
                    }
                ids.append(index)
                index += 1
                offset += p.numel()
            groups.append({**{k: v for k, v in live.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        assert self._opt is not None and self.optimizer is not None
        saved_groups = state["param_groups"]
        if len(saved_groups) != len(self._groups) or any(
            len(s["params"]) != len(g) for s, g in zip(saved_groups, self._groups, strict=True)
        ):
            raise ValueError(
                "the optimizer state dict does not match this optimizer's parameter groups "
                f"({[len(s['params']) for s in saved_groups]} vs {[len(g) for g in self._groups]})"
            )
        shard_state: dict[int, dict[str, Any]] = {}
        shard_groups: list[dict[str, Any]] = []
        for g, (saved, live) in enumerate(
            zip(saved_groups, self.optimizer.param_groups, strict=True)
        ):
            live.update({k: v for k, v in saved.items() if k != "params"})
            per_param = [state["state"].get(i, state["state"].get(str(i))) for i in saved["params"]]
            a, b = self._opt.owned(g)
            if per_param and all(s for s in per_param):
                mine: dict[str, Any] = {}
                for key, first in per_param[0].items():
                    if isinstance(first, torch.Tensor) and first.dim() > 0:
                        full = torch.cat([s[key].reshape(-1) for s in per_param])
                        mine[key] = full[a:b].clone()
                    else:
                        mine[key] = first
                shard_state[g] = mine
            shard_groups.append({**{k: v for k, v in live.items() if k != "params"}, "params": [g]})
        self._opt.load_state_dict({"state": shard_state, "param_groups": shard_groups})

    def model_loaded(self) -> None:
        """The model's (loaded) values become this rank's master slice."""
        assert self._arp is not None
        start, length = self._arp.local_partition_range
        with torch.no_grad():
            self._arp.weight_partition.copy_(self._flat[start : start + length])
        self._arp.send_weight_partition()

    def close(self) -> None:
        if self._arp is not None:
            self._arp.close()
        super().close()
