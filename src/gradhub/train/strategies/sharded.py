"""``sharded``: synchronous training on AllReduceParameter, optimizer state sharded.

BigDL's scheme with ZeRO-1's memory saving. The model's parameters become
views of one flat fp32 vector; rank r of P owns slice r of it. Per step:

1. backward on the local batch; the flat gradient, scaled by the samples this
   rank processed, is reduce-scattered (optionally compressed on the wire:
   ``compress="bf16"`` etc.) so each rank holds the sum of its own slice;
2. the owner divides by ``global_samples`` (the weighted mean: exact for
   uneven batches) and steps its optimizer on its slice only, so momentum or
   Adam state exists once across the job instead of once per rank;
3. the updated slices are all-gathered straight into the flat vector the
   parameters view.

Decisions:
- The optimizer passed to the trainer is a template: its class and the
  hyper-parameters of its first parameter group are used to build the
  per-slice optimizer (:class:`~gradhub.collective.ShardedOptimizer`); the
  template itself is never stepped and keeps no state.
- Checkpoints hold each rank's optimizer shard, so a sharded job resumes with
  the same number of ranks only.
- Model buffers are broadcast from rank 0 at set-up, not per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradhub import codecs
from gradhub.collective import AllReduceParameter, CollectiveGroup, ShardedOptimizer
from gradhub.train.strategies.base import Closure, Strategy


@dataclass(kw_only=True)
class ShardedConfig:
    """Settings of the ``sharded`` strategy."""

    compress: str = "none"
    """Wire codec for gradients and weights: ``"none"``, ``"fp16"``, ``"bf16"``,
    ``"bf16-truncate"``; arithmetic and master weights stay fp32."""

    def __post_init__(self) -> None:
        codecs.get(self.compress)  # an unknown codec is an error now, not mid-job


class ShardedStrategy(Strategy):
    """Reduce-scatter, owner-side optimizer step (ZeRO-1), all-gather."""

    name = "sharded"

    def __init__(self, config: ShardedConfig | None = None, **options: Any) -> None:
        super().__init__()
        if config is not None and options:
            raise TypeError("pass either config= or keyword options, not both")
        self.config = config or ShardedConfig(**options)
        self._params: list[torch.nn.Parameter] = []
        self._flat = torch.zeros(0)
        self._grad = torch.zeros(0)
        self._arp: AllReduceParameter | None = None
        self._opt: ShardedOptimizer | None = None

    def _setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        if optimizer is None:
            raise ValueError(
                "strategy 'sharded' needs an optimizer to use as template (class and settings)"
            )
        self._params = [p for p in model.parameters() if p.requires_grad]
        if not self._params:
            raise ValueError("the model has no parameters that require gradients")
        if any(p.dtype != torch.float32 for p in self._params):
            raise ValueError("strategy 'sharded' trains fp32 parameters; call model.float()")
        self._broadcast_from_rank0(model)
        device = self._params[0].device
        size = sum(p.numel() for p in self._params)
        self._flat = torch.cat([p.detach().reshape(-1) for p in self._params]).to(device)
        self._grad = torch.zeros_like(self._flat)
        offset = 0
        for p in self._params:  # parameters become views of the flat vector
            p.data = self._flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        group = CollectiveGroup.of(None, timeout=self.runtime.timeout)
        self._arp = AllReduceParameter(size, group=group, compress=self.config.compress)
        self._arp.init(self._flat)
        cls = type(optimizer)
        settings = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        self._opt = ShardedOptimizer(self._arp, lambda params: cls(params, **settings))

    def step(self, closure: Closure, samples: int, global_samples: int) -> None:
        self._check_counts(samples, global_samples)
        assert self._arp is not None and self._opt is not None
        for p in self._params:
            p.grad = None
        if samples > 0:
            closure().backward()
        offset = 0
        for p in self._params:
            slot = self._grad[offset : offset + p.numel()]
            if p.grad is None:
                slot.zero_()
            else:
                torch.mul(p.grad.reshape(-1), float(samples), out=slot)
            offset += p.numel()
        self._arp.put_gradients(self._grad)
        self._opt.step(avg_numbers=global_samples)
        self._arp.get_weights(self._flat).wait()
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        assert self._opt is not None
        return {**super().state_dict(), "optimizer_shard": self._opt.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the shard; the model's (already loaded) values become the master slice."""
        super().load_state_dict(state)
        assert self._opt is not None and self._arp is not None
        start, length = self._arp.local_partition_range
        self._arp.weight_partition.copy_(self._flat[start : start + length])
        self._arp.send_weight_partition()
        self._opt.load_state_dict(state["optimizer_shard"])

    def close(self) -> None:
        if self._arp is not None:
            self._arp.close()
        super().close()
