"""The model :func:`gradhub.prepare` returns: the user's module, made distributed.

Calls go straight through to the original module (``model.module``).
Unlike DDP's wrapper, ``state_dict()`` and ``load_state_dict()`` are the
original module's, keys unchanged (no ``module.`` prefix), so checkpoints
load into a plain model; attributes the wrapper does not have are looked up
on the original module.

DDP's surface, each as DDP documents it (decisions in
:mod:`gradhub.train.strategies.base` and :mod:`.strategies.forward`):

- ``require_backward_grad_sync`` (read and set, as nanoGPT does per
  micro-step) *is* the strategy's sync flag; ``no_sync()`` sets it for a
  block. Whether a backward synchronises is decided at the model's forward
  with grad enabled, as DDP decides it.
- ``forward`` broadcasts buffers from rank 0 first where DDP would
  (``broadcast_buffers``) and, inside ``join()``, tells the joined ranks.
- ``join()`` (uneven inputs) and ``register_comm_hook(state, hook)``: under
  ``allreduce``; elsewhere a :class:`~gradhub.errors.MisuseError` saying what
  to use instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gradhub.errors import InvalidOptionError
from gradhub.train.strategies import Strategy


class PreparedModel(torch.nn.Module):
    """Wraps ``module``; the ``strategy`` keeps its replicas in step across ranks."""

    def __init__(self, module: torch.nn.Module, strategy: Strategy) -> None:
        super().__init__()
        self.module = module
        self._gradhub_strategy = strategy

    @property
    def strategy(self) -> Strategy:
        """The strategy that keeps this model's replicas equal."""
        return self._gradhub_strategy

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        strategy = self._gradhub_strategy
        strategy.before_forward()
        out = self.module(*args, **kwargs)
        strategy.after_forward()
        return out

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether the next backward synchronises (DDP's attribute; ``no_sync`` sets it)."""
        return self._gradhub_strategy.sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._gradhub_strategy.sync = bool(value)

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> contextlib.AbstractContextManager[Any]:
        """DDP's ``join()`` for uneven inputs (see :mod:`gradhub.train.strategies.join`)."""
        return self._gradhub_strategy.join(
            divide_by_initial_world_size=divide_by_initial_world_size,
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
        )

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """DDP's ``register_comm_hook`` (``allreduce`` only; elsewhere use ``compress=``)."""
        self._gradhub_strategy.register_comm_hook(state, hook)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Backward passes inside only accumulate gradients locally, as DDP's ``no_sync``.

        Use it for every micro-batch of a gradient-accumulation step but the
        last; the last one's backward (outside) combines the accumulated sum.
        """
        return self._gradhub_strategy.no_sync()

    def set_samples(self, samples: int, global_samples: int | None = None) -> None:
        """Weight this rank by its ``samples`` in the next optimizer step.

        Without it every rank counts the same (DDP's mean of means). With it the
        step uses ``sum(n_i * g_i) / sum(n_i)``: exactly the single-process step
        on the whole global batch, also when the last batches are uneven. Give
        ``global_samples`` when known (saves a division pass); call it before
        the synchronising backward of each step.
        """
        self._gradhub_strategy.set_samples(samples, global_samples)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The original module's state dict (same keys)."""
        self._gradhub_strategy.refresh()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load into the original module (same keys); every rank must load the same values.

        A checkpoint written from a DDP wrapper (every key under ``module.``) loads
        too, as it would into that wrapper: the prefix is taken off.
        """
        if assign:
            raise InvalidOptionError("assign=True would replace the parameters the strategy holds")
        keys = list(state_dict)
        own = self.module.state_dict(keep_vars=True)
        if (
            keys
            and all(k.startswith("module.") for k in keys)
            and not any(k.startswith("module.") for k in own)
        ):
            state_dict = {k[len("module.") :]: v for k, v in state_dict.items()}
        with torch.no_grad():
            result = self.module.load_state_dict(state_dict, strict=strict)
        self._gradhub_strategy.model_loaded()
        return result

    def close(self) -> None:
        """Release the strategy's hooks, threads and connections. Idempotent."""
        self._gradhub_strategy.close()

    def __enter__(self) -> PreparedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = super().__getattr__("module")
            return getattr(module, name)
