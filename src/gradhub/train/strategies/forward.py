"""The forward side of DDP's surface, for every strategy: buffers, ``join()``, comm hooks.

Set-up gives every rank rank 0's parameters (frozen ones too) and buffers
(every dtype). Before a forward that follows a forward with grad enabled
and sync on, buffers are broadcast from rank 0 (DDP's
``broadcast_buffers=True``); :class:`~gradhub.train.ddp_options.DDPOptions`
turns either off.
``join()`` (:mod:`.join`) for strategies that set :attr:`supports_join`;
``register_comm_hook`` where :meth:`register_comm_hook` is overridden.
Elsewhere both are a :class:`~gradhub.errors.MisuseError` at the call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from gradhub.errors import MisuseError
from gradhub.train.ddp_options import DDPOptions
from gradhub.train.strategies.join import Join
from gradhub.train.strategies.part import StrategyPart
from gradhub.train.strategies.replicas import broadcast_tensors
from gradhub.train.strategies.survival import PEER_FAILURES


class ForwardSide(StrategyPart):
    """The forward-side part of :class:`~gradhub.train.strategies.base.Strategy`.

    What it needs of the strategy, besides the runtime (:class:`.StrategyPart`):
    the attributes below, and :attr:`_shadow_sync` where :attr:`supports_join`.
    """

    supports_join: ClassVar[bool] = False
    """Whether ``model.join()`` works (the strategy provides :attr:`_shadow_sync`)."""
    model: torch.nn.Module | None
    ddp: DDPOptions
    sync: bool
    _join: Join | None
    _forward_param_sync: bool
    _sync_at_forward: bool | None
    _has_buffers: bool | None = None
    """Whether the model has buffers, looked up at the first forward that would
    broadcast them (walking the modules costs about 2 us each, every step)."""
    _shadow_sync: Callable[[], None]
    """A joined rank's part in one synchronising backward of the others (zero
    gradients, weight 0); only a strategy that :attr:`supports_join` has it."""

    def join(self, **options: bool) -> Join:
        """``model.join()`` (see :mod:`.join`)."""
        if not self.supports_join:
            raise MisuseError(
                f"join() is not available under strategy {self.name!r}: a step there is "
                "a collective a rank without data cannot shadow\n- help: use "
                "strategy='allreduce', or give every rank the same number of batches "
                "(DistributedSampler(drop_last=True))"
            )
        if self.runtime.survive:
            raise MisuseError(
                "join() in a surviving job (gradhub run --survive): the ranks' shares "
                "change when a worker dies, so which ranks run out of data first cannot be "
                "known in advance\n- help: use gradhub.GlobalBatchSampler, which gives "
                "every rank a share of every global batch, and drop join()"
            )
        return Join(self, **options)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        """DDP's ``register_comm_hook``; only ``allreduce`` takes one."""
        raise MisuseError(
            f"register_comm_hook is not available under strategy {self.name!r}\n- help: "
            "pass compress='fp16' or 'bf16' (or 'powersgd' under allreduce) to gradhub.prepare"
        )

    def before_forward(self) -> None:
        """The prepared model's forward starts: join's notice, buffers from rank 0."""
        buffers = self._forward_param_sync and self.ddp.sync_buffers_at_forward
        if buffers and self._has_buffers is None:  # looked up once, as DDP does
            self._has_buffers = bool(self._buffers())
        buffers = buffers and bool(self._has_buffers)
        src = 0
        if self._join is not None:
            src = self._join.notify(torch.is_grad_enabled() and self.sync, buffers)
        if buffers and self.world_size > 1:
            self._broadcast(self._buffers(), src)

    def after_forward(self) -> None:
        """The prepared model's forward ended: remember whether it syncs (DDP's rule)."""
        grad = torch.is_grad_enabled()
        self._forward_param_sync = grad and self.sync
        if grad:
            self._sync_at_forward = self.sync

    def _broadcast_from_rank0(self, model: torch.nn.Module) -> None:
        """Give every replica rank 0's parameters (frozen ones too) and buffers."""
        tensors = [p.data for p in model.parameters()]
        if self.ddp.sync_buffers_at_setup:
            tensors += [b for b in model.buffers()]
        while self.runtime.world_size > 1 and self.runtime.joined is None:
            try:
                self._broadcast(tensors, 0)  # a replacement takes the survivors' state instead
                return
            except PEER_FAILURES as exc:  # a surviving job: again from the new rank 0
                self.runtime.regroup(exc)  # raises exc without survival

    def _buffers(self) -> list[torch.Tensor]:
        return [] if self.model is None else list(self.model.buffers())

    def _broadcast(self, tensors: list[torch.Tensor], src: int) -> None:
        broadcast_tensors(tensors, src, self._wait)
