"""Loss scaling (:class:`gradhub.GradScaler`, ``precision="fp16"``), for every strategy.

Loss scaling (:class:`gradhub.GradScaler`, ``precision="fp16"``): after the
synchronising backward, :meth:`unscale_` multiplies the *combined*
gradient (the one :meth:`apply` and :meth:`clip_grad_norm_` use) by
``1 / scale`` and says whether it holds inf or NaN. Every rank whose
update depends on the others' (``allreduce``, ``sharded``, ``ps-sync``)
gets the same answer; ``ps-async``/``ps-ssp`` decide per worker, since a
worker's push is applied on its own. On "found inf" the scaler calls
:meth:`skip` instead of :meth:`apply`: no update, the per-step bookkeeping
is reset as by a step. A skipped step counts in :attr:`steps` (the loop's
step count, as ``fit`` and its checkpoints count) and in
:attr:`skipped_steps`. :meth:`use_loss_scaling` tells the strategy that
gradients are scaled from now on, so that a wire codec lets an overflow
through as inf instead of saturating it into a finite, wrong value.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradhub.errors import MisuseError
from gradhub.train.strategies.part import StrategyPart
from gradhub.train.strategies.replicas import unscale_tensors


class LossScaling(StrategyPart):
    """The loss-scaling part of :class:`~gradhub.train.strategies.base.Strategy`.

    What it needs of the strategy, besides the runtime (:class:`.StrategyPart`):
    the attributes below, and :attr:`_step_done`.
    """

    params: list[torch.nn.Parameter]
    skipped_steps: int
    _in_backward: bool
    _synced: bool
    _samples: tuple[int, int | None] | None
    _step_done: Callable[[], None]
    """The bookkeeping of a step that ends (:meth:`skip` ends one too)."""

    def use_loss_scaling(self) -> None:
        """Gradients are loss-scaled from now on (called by :class:`gradhub.GradScaler`).

        Default: nothing to change. A strategy whose wire codec saturates
        (``sharded`` with ``compress="fp16"``) switches to one that turns an
        overflow into inf, so :meth:`unscale_` finds it.
        """
        return None

    def unscale_(self, inv_scale: float) -> bool:
        """Multiply the combined gradient by ``inv_scale``; True if it holds inf or NaN.

        Call it after the synchronising backward, before :meth:`clip_grad_norm_`
        and :meth:`apply` / :meth:`skip`. The answer is the same on every rank
        that shares the step (see the module docstring).
        """
        self._check_step_ready("unscale_")
        return self._unscale(float(inv_scale))

    def _unscale(self, inv_scale: float) -> bool:
        """Default: the ``.grad`` of the parameters is the combined gradient,
        the same bits on every rank (``allreduce``), so a local check agrees."""
        return unscale_tensors([p.grad for p in self.params if p.grad is not None], inv_scale)

    def skip(self) -> None:
        """End this step without an update (a loss scaler found inf).

        Resets the per-step bookkeeping as :meth:`apply` does, so the next
        backward is the next step's; counts in :attr:`steps` and
        :attr:`skipped_steps`. Every rank that shares the step skips it
        (the scaler's agreed decision); under ``ps-ssp`` the skip still
        advances this worker's clock on the servers (see :mod:`.ps`).
        """
        self._check_step_ready("skip")
        try:
            self._skip()
        finally:
            self._synced = False
            self._samples = None
        self.skipped_steps += 1
        self._step_done()

    def _skip(self) -> None:
        """Drop what this step prepared for :meth:`_apply` (default: nothing)."""
        return None

    def _agree(self, found: bool) -> bool:
        """True on every rank if ``found`` on any (one all-reduce of a flag)."""
        flag = torch.tensor([1.0 if found else 0.0], device=self.params[0].device)
        return bool(self.runtime.all_reduce_sum(flag, where="loss scaling: found inf")[0] > 0)

    def _check_step_ready(self, what: str) -> None:
        if self._in_backward:
            raise MisuseError(f"{what} called during backward()")
        if not self._synced:
            raise MisuseError(
                f"{what} without a backward() outside no_sync() since the last step: the "
                "gradients were never combined across ranks\n- help: call it after the "
                "last micro-batch's backward, before optimizer.step()"
            )
