"""ShardedOptimizer: any ``torch.optim`` optimizer over the owned slice (ZeRO-1).

Each rank's optimizer sees only its ``AllReduceParameter.weight_partition``,
so optimizer state (momentum, Adam's moments) exists for that slice only and
is spread over the ranks instead of copied on each.

.. code-block:: python

    opt = ShardedOptimizer(p, lambda params: torch.optim.Adam(params, lr=1e-3))
    p.put_gradients(grads)
    opt.step(avg_numbers=global_batch_size)   # aggregate, step, publish
    p.get_weights(weights).wait()

Parameter groups: given an :class:`~gradhub.optim.OptimizerSpec` and
``group_sizes`` (how many elements of the flat vector each of the spec's
groups covers, back to back), the slice is cut where it crosses group
boundaries and each piece (possibly empty) is one parameter group of the slice
optimizer with that group's hyperparameters, so weight-decay groups and
per-group learning rates work as in the single-process optimizer.
``views[g]`` and ``ranges[g]`` (start, end in the flat vector) say which part
of group ``g`` this rank owns.

Decisions: ``step`` does aggregate -> optimizer step -> ``send_weight_partition``,
the three calls every caller would otherwise repeat. The aggregated gradient
is set as each piece's ``.grad`` for the step only and cleared after, so
no stale gradient survives. An empty slice (``size < world size``) is
stepped like any other (torch optimizers accept empty tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradhub.collective.allreduce_parameter import AllReduceParameter
from gradhub.errors import StateError
from gradhub.optim import OptimizerFactory, OptimizerSpec


class ShardedOptimizer:
    """Steps ``parameter.weight_partition`` with the optimizer ``optimizer`` describes.

    ``optimizer``: a factory that receives ``[weight_partition]`` and returns any
    ``torch.optim.Optimizer`` (one group), or an ``OptimizerSpec`` with
    ``group_sizes`` (one group per spec group). ``parameter`` must be
    initialised (``init``).
    """

    def __init__(
        self,
        parameter: AllReduceParameter,
        optimizer: OptimizerFactory | OptimizerSpec,
        *,
        group_sizes: Sequence[int] | None = None,
    ):
        if not parameter.initialized:
            raise StateError(
                f"[rank {parameter.partition_id}] ShardedOptimizer needs an initialised "
                "AllReduceParameter; call parameter.init(weights) first"
            )
        self.parameter = parameter
        start, length = parameter.local_partition_range
        weights = parameter.weight_partition
        sizes = list(group_sizes) if group_sizes is not None else [parameter.size]
        if sum(sizes) != parameter.size or any(s < 0 for s in sizes):
            raise ValueError(f"group_sizes {sizes} must add up to the size {parameter.size}")
        self.ranges: list[tuple[int, int]] = []
        self.views: list[torch.Tensor] = []
        self._cuts: list[tuple[int, int]] = []  # per group: [a, b) within the slice
        offset = 0
        for size in sizes:
            a = min(max(offset, start), start + length) - start
            b = min(max(offset + size, start), start + length) - start
            self.ranges.append((offset, offset + size))
            self._cuts.append((a, b))
            self.views.append(weights[a:b] if len(sizes) > 1 else weights)
            offset += size
        if isinstance(optimizer, OptimizerSpec):
            self.optimizer = optimizer.build([[v] for v in self.views])
        else:
            if group_sizes is not None and len(sizes) > 1:
                raise ValueError("several groups need an OptimizerSpec, not a factory")
            self.optimizer = optimizer([weights])
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"the factory must return a torch.optim.Optimizer, got {type(self.optimizer)!r}"
            )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (for learning-rate schedules)."""
        return self.optimizer.param_groups

    def owned(self, group: int) -> tuple[int, int]:
        """The part of group ``group`` this rank owns, as offsets into that group."""
        a, b = self._cuts[group]
        start = self.parameter.local_partition_range[0]
        first = self.ranges[group][0]
        return start + a - first, start + b - first

    def step(self, avg_numbers: float = 1) -> torch.Tensor:
        """Aggregate the gradients put with ``put_gradients`` (divided by
        ``avg_numbers``), step the optimizer on the owned slice and publish it.

        Returns the updated ``weight_partition``.
        """
        return self.apply(self.parameter.aggregate_gradient_partition(avg_numbers))

    def apply(self, gradient: torch.Tensor) -> torch.Tensor:
        """Step with ``gradient`` (this slice's, already aggregated) and publish."""
        for view, (a, b) in zip(self.views, self._cuts, strict=True):
            view.grad = gradient[a:b] if len(self.views) > 1 else gradient
        try:
            self.optimizer.step()
        finally:
            for view in self.views:
                view.grad = None
        self.parameter.send_weight_partition()
        return self.parameter.weight_partition

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
