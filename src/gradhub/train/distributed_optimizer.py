"""The optimizer :func:`gradhub.prepare` returns.

An instance of ``torch.optim.Optimizer`` (so LR schedulers take it) whose
``step()`` is the strategy's: combine every rank's gradients and update the
parameters (``allreduce``: the script's optimizer steps on every rank;
``sharded``: reduce-scatter, the slice optimizer's step, all-gather;
``ps-*``: push to the servers, pull).

- ``param_groups`` *are* the script's optimizer's groups (the same list), so
  an LR change or a scheduler step made through either object takes effect at
  the next step under every strategy.
- ``state_dict()`` is the full optimizer state in the single-process
  optimizer's own format (under ``sharded`` assembled from every rank's
  slice; under ``ps-*`` fetched from the servers, where it lives; call it on
  every rank), loadable by a plain optimizer or a job of any world size;
  ``load_state_dict()`` takes such a dict (a collective as well).
- ``zero_grad()`` clears the model's gradients, as the original's would.
- Parameter groups are fixed at ``prepare``: ``add_param_group`` is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradhub.errors import MisuseError
from gradhub.train.strategies import Strategy


class DistributedOptimizer(torch.optim.Optimizer):
    """The script's ``optimizer``, stepped through ``strategy``."""

    def __init__(self, optimizer: torch.optim.Optimizer, strategy: Strategy) -> None:
        self._ready = False
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        """The script's optimizer (do not step it: its step raises ``MisuseError``)."""
        self.strategy = strategy
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.state = optimizer.state
        self._ready = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Combine the ranks' gradients and update the parameters; returns ``closure()``."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.strategy.apply()
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm (see :func:`gradhub.clip_grad_norm_`)."""
        return self.strategy.clip_grad_norm_(max_norm, norm_type)

    def state_dict(self) -> dict[str, Any]:
        return self.strategy.optimizer_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.strategy.load_optimizer_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_ready", False):
            raise MisuseError(
                "parameter groups are fixed at gradhub.prepare\n- help: add the group to "
                "the optimizer before handing it to gradhub.prepare"
            )
        super().add_param_group(param_group)

    def close(self) -> None:
        """Release the strategy's hooks, threads and connections. Idempotent."""
        self.strategy.close()

    def __enter__(self) -> DistributedOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, strategy={self.strategy.name!r})"
