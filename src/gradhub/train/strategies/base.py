"""The strategy interface: how one training step is synchronised across ranks.

Contract, for every strategy (one module each):

- :meth:`Strategy.setup` is called once per process, after ``gradhub.init()``,
  with the model (already on ``runtime.device``), the local optimizer (or
  ``None`` where the optimizer lives elsewhere, e.g. on parameter servers) and
  the :class:`~gradhub.train.runtime.Runtime`. It makes every replica start
  from the same parameters.
- :meth:`Strategy.step` runs one synchronous (or, for parameter servers,
  possibly asynchronous) data-parallel step. Every rank calls it the same
  number of times. ``closure()`` runs the forward pass on this rank's part of
  the global batch and returns the mean loss over its ``samples`` samples; the
  strategy runs backward, combines gradients from every rank weighted by
  samples (so the result is the gradient of the mean loss over the
  ``global_samples`` samples of the global batch) and updates the model.
- :meth:`Strategy.refresh` brings the local model up to date with the shared
  parameters before evaluation or a checkpoint (a no-op where every step
  already leaves the replicas equal). A
  rank with ``samples == 0`` still calls ``step`` (its closure is not called)
  so collectives stay matched.
- :meth:`Strategy.state_dict` / :meth:`Strategy.load_state_dict` hold what a
  checkpoint needs beyond the model's own state (optimizer state, counters).
- :meth:`Strategy.close` releases hooks, sockets and threads; idempotent.
- A peer that dies or stops answering makes :meth:`step` raise
  :class:`~gradhub.errors.WorkerFailedError` naming it, or
  :class:`~gradhub.errors.CollectiveTimeoutError`, within the runtime's
  timeout: never a hang.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from gradhub.errors import ClosedError, StateError
from gradhub.train.runtime import Runtime

Closure = Callable[[], torch.Tensor]
"""Runs the forward pass on the local batch and returns its mean loss."""


class Strategy(abc.ABC):
    """One way of keeping data-parallel replicas in step."""

    name: ClassVar[str]
    """The name users pass as ``strategy=``."""

    def __init__(self) -> None:
        self._runtime: Runtime | None = None
        self._closed = False
        self.steps = 0
        """Steps completed by this process."""

    @property
    def runtime(self) -> Runtime:
        if self._closed:
            raise ClosedError(f"strategy {self.name!r} was closed")
        if self._runtime is None:
            raise StateError(f"strategy {self.name!r} is not set up; call setup() first")
        return self._runtime

    def setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        runtime: Runtime,
    ) -> None:
        """Attach to a model and optimizer; replicas start equal after this."""
        if self._runtime is not None:
            raise StateError(f"strategy {self.name!r} is already set up")
        runtime.check_open()
        self._runtime = runtime
        self._setup(model, optimizer)

    @abc.abstractmethod
    def _setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None: ...

    @abc.abstractmethod
    def step(self, closure: Closure, samples: int, global_samples: int) -> None:
        """One data-parallel step; see the module docstring for the contract."""

    def refresh(self) -> None:
        """Make the local model reflect the shared parameters (default: nothing to do)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds beyond the model's parameters."""
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))

    def close(self) -> None:
        """Release hooks, sockets and threads. Idempotent."""
        self._closed = True

    # helpers shared by strategies -------------------------------------------------

    def _check_counts(self, samples: int, global_samples: int) -> None:
        if samples < 0 or global_samples <= 0 or samples > global_samples:
            raise ValueError(
                f"need 0 <= samples <= global_samples and global_samples > 0, "
                f"got samples={samples}, global_samples={global_samples}"
            )

    def _broadcast_from_rank0(self, model: torch.nn.Module) -> None:
        """Give every replica rank 0's parameters and floating-point buffers."""
        tensors = [t.data for t in model.parameters()] + list(model.buffers())
        tensors = [t for t in tensors if t.is_floating_point()]
        if self.runtime.world_size == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        self._wait(dist.broadcast(flat, src=0, async_op=True), "broadcast")
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def _wait(self, work: Any, operation: str) -> None:
        """Bounded wait on a c10d work item; failures name the rank(s) responsible."""
        self.runtime.wait(work, operation, where=f"step {self.steps} of strategy {self.name!r}")
