"""ShardedOptimizer: any ``torch.optim`` optimizer over the owned slice (ZeRO-1).

Each rank's optimizer sees one tensor, its ``AllReduceParameter.weight_partition``,
so optimizer state (momentum, Adam's moments) exists for that slice only and
is spread over the ranks instead of copied on each.

.. code-block:: python

    opt = ShardedOptimizer(p, lambda params: torch.optim.Adam(params, lr=1e-3))
    p.put_gradients(grads)
    opt.step(avg_numbers=global_batch_size)   # aggregate, step, publish
    p.get_weights(weights).wait()

Decisions: ``step`` does aggregate -> optimizer step -> ``send_weight_partition``,
the three calls every caller would otherwise repeat. The aggregated gradient
is set as ``weight_partition.grad`` for the step only and cleared after, so
no stale gradient survives. An empty slice (``size < world size``) is
stepped like any other (torch optimizers accept empty tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradhub.collective.allreduce_parameter import AllReduceParameter
from gradhub.errors import StateError

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]


class ShardedOptimizer:
    """Steps ``parameter.weight_partition`` with the optimizer ``factory`` builds.

    ``factory`` receives ``[weight_partition]`` and returns any
    ``torch.optim.Optimizer``. ``parameter`` must be initialised (``init``).
    """

    def __init__(self, parameter: AllReduceParameter, factory: OptimizerFactory):
        if not parameter.initialized:
            raise StateError(
                f"[rank {parameter.partition_id}] ShardedOptimizer needs an initialised "
                "AllReduceParameter; call parameter.init(weights) first"
            )
        self.parameter = parameter
        self.optimizer = factory([parameter.weight_partition])
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"the factory must return a torch.optim.Optimizer, got {type(self.optimizer)!r}"
            )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (for learning-rate schedules)."""
        return self.optimizer.param_groups

    def step(self, avg_numbers: float = 1) -> torch.Tensor:
        """Aggregate the gradients put with ``put_gradients`` (divided by
        ``avg_numbers``), step the optimizer on the owned slice and publish it.

        Returns the updated ``weight_partition``.
        """
        grad = self.parameter.aggregate_gradient_partition(avg_numbers)
        weights = self.parameter.weight_partition
        weights.grad = grad
        try:
            self.optimizer.step()
        finally:
            weights.grad = None
        self.parameter.send_weight_partition()
        return weights

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
