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
  slice; under ``ps-*`` fetched from the servers, where it lives), loadable
  by a plain optimizer or a job of any world size. Rank 0 alone may call it
  (a checkpoint written by rank 0): it never waits for the other ranks to
  call it too. ``load_state_dict()`` takes such a dict on every rank.
- ``zero_grad(set_to_none=True)`` is torch's own, over the same groups:
  ``None`` gradients, or zeros in place (``set_to_none=False``; under
  ``allreduce`` the zeros land in the bucket ``.grad`` is a view of).
- Under ``allreduce`` ``state_dict()`` is the script's optimizer's own,
  local: rank 0 alone may call it (a checkpoint written by rank 0) and
  nothing waits for the other ranks. ``prepare(model, [opt_a, opt_b])``
  returns one of these per optimizer (``index`` says which); step each.
- Parameter groups are fixed at ``prepare``: ``add_param_group`` is an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradhub.errors import MisuseError
from gradhub.train.strategies import Strategy
from gradhub.train.strategies.base import load_keeping_objects


class DistributedOptimizer(torch.optim.Optimizer):
    """The script's ``optimizer``, stepped through ``strategy``."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, strategy: Strategy, index: int = 0
    ) -> None:
        self._ready = False
        self.index = index
        """Which of the optimizers handed to ``prepare`` this is."""
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
        self.strategy.apply(self.index)
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm (see :func:`gradhub.clip_grad_norm_`)."""
        return self.strategy.clip_grad_norm_(max_norm, norm_type)

    def state_dict(self) -> dict[str, Any]:
        if self.index:
            return self.optimizer.state_dict()  # only allreduce takes several: local state
        return self.strategy.optimizer_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.index:
            load_keeping_objects(self.optimizer, state_dict)
        else:
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
