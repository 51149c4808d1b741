"""``gradhub.GradScaler``: dynamic loss scaling for fp16, agreed across ranks.

The interface of ``torch.amp.GradScaler``, over the optimizer
:func:`gradhub.prepare` returned:

.. code-block:: python

    model, optimizer = gradhub.prepare(model, optimizer, strategy="sharded")
    scaler = gradhub.GradScaler(optimizer)
    for x, y in loader:
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)              # optional: before clipping
        gradhub.clip_grad_norm_(model, 1.0)
        scaler.step(optimizer)                  # skipped if the gradient overflowed
        scaler.update()

What differs from torch's, and why:

- The gradient unscaled and checked is the *combined* one (the strategy's
  :meth:`~gradhub.train.strategies.Strategy.unscale_`), and the found-inf
  decision is the same on every rank that shares the step: ``allreduce``
  checks gradients that are the same bits everywhere after the reduction;
  ``sharded`` and ``ps-sync`` all-reduce the flag. A step skipped on one of
  those ranks is skipped on all, so the replicas never diverge and no
  collective or sync round waits for a rank that skipped. ``ps-async`` and
  ``ps-ssp`` decide per worker (each push is applied on its own); each
  worker's scale then follows its own gradients.
- Because the decision is agreed, the scale and its growth tracker move the
  same on every such rank: they stay equal without being communicated.
- A gradient that overflows on the wire (``compress="fp16"``) counts as
  found inf, never as a saturated value (see the strategies).
- A skipped step still counts as a step of the strategy (``steps``) and an LR
  scheduler still steps after it, as with torch's scaler (whose first,
  skipped step makes torch warn that the scheduler stepped before the
  optimizer; here the skipped step is recorded as the optimizer's step, so
  no warning).
- The scale is a Python float: multiplying the loss by a power of two is
  exact, so ``scale(loss)`` has the bits torch's gives (a loss in fp16 or
  bf16 is scaled in fp32, as torch's fp32 scale tensor promotes it).
- It holds no thread, socket or process group, so it needs no ``close()``
  (torch's has none either).
- ``state_dict()`` has torch's keys (``scale``, ``growth_factor``,
  ``backoff_factor``, ``growth_interval``, ``_growth_tracker``): a torch
  scaler's state loads here and the other way round.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from gradhub.errors import InvalidOptionError, MisuseError, WrongTypeError
from gradhub.train.distributed_optimizer import DistributedOptimizer


class _Stage(enum.Enum):
    READY = 0  # since the last update(): nothing done yet
    UNSCALED = 1  # unscale_ ran this step
    STEPPED = 2  # step ran (or skipped) this step


class GradScaler:
    """Dynamic loss scaling over a prepared optimizer (``torch.amp.GradScaler``'s interface).

    Args:
        optimizer: the optimizer :func:`gradhub.prepare` returned.
        init_scale: the first scale.
        growth_factor: the scale is multiplied by it after ``growth_interval``
            steps in a row without inf or NaN.
        backoff_factor: the scale is multiplied by it after a step with inf or NaN.
        growth_interval: see ``growth_factor``.
        enabled: ``False`` makes every method a pass-through (``step`` is a
            plain ``optimizer.step()``), so one script runs with and without fp16.
    """

    def __init__(
        self,
        optimizer: DistributedOptimizer,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        if not isinstance(optimizer, DistributedOptimizer):
            raise WrongTypeError(
                f"GradScaler takes the optimizer gradhub.prepare returned, got "
                f"{type(optimizer).__name__}\n- help: model, optimizer = gradhub.prepare(model, "
                "optimizer, ...); scaler = gradhub.GradScaler(optimizer) (torch.amp.GradScaler "
                "would unscale one rank's gradient and skip steps on some ranks only)"
            )
        if not init_scale > 0 or not growth_factor > 1.0 or not 0.0 < backoff_factor < 1.0:
            raise InvalidOptionError(
                "need init_scale > 0, growth_factor > 1 and 0 < backoff_factor < 1, got "
                f"init_scale={init_scale}, growth_factor={growth_factor}, "
                f"backoff_factor={backoff_factor}"
            )
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int):
            raise WrongTypeError(f"growth_interval must be an int, got {growth_interval!r}")
        if growth_interval < 1:
            raise InvalidOptionError(f"growth_interval must be >= 1, got {growth_interval}")
        self.optimizer = optimizer
        self._enabled = bool(enabled)
        self._scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._growth_tracker = 0
        self._stage = _Stage.READY
        self._found_inf = False
        if self._enabled:
            optimizer.strategy.use_loss_scaling()

    # the loop ----------------------------------------------------------------------

    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or a list, tuple or dict of them) times the scale."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            if outputs.dtype in (torch.float16, torch.bfloat16):
                outputs = outputs.float()
            return outputs * self._scale
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, dict):
            return {k: self.scale(v) for k, v in outputs.items()}
        raise WrongTypeError(f"scale() takes tensors, got {type(outputs).__name__}")

    def unscale_(self, optimizer: DistributedOptimizer) -> None:
        """Divide the combined gradient by the scale, in place, and record
        whether it holds inf or NaN (agreed across the ranks that share the step).

        Optional: ``step`` calls it if it was not called. Call it once per
        step, after the last ``backward`` and before clipping.
        """
        if not self._enabled:
            return
        self._check_optimizer(optimizer)
        if self._stage is _Stage.UNSCALED:
            raise MisuseError(
                "unscale_() was already called on this optimizer since the last update()"
            )
        if self._stage is _Stage.STEPPED:
            raise MisuseError("unscale_() is being called after step(); call update() first")
        self._found_inf = optimizer.strategy.unscale_(1.0 / self._scale)
        self._stage = _Stage.UNSCALED

    def step(self, optimizer: DistributedOptimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale (if not done), then step, or skip the step on every rank that
        shares it if the gradient holds inf or NaN. Returns what ``step`` returned,
        ``None`` when skipped."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        self._check_optimizer(optimizer)
        if "closure" in kwargs or args:
            raise MisuseError("closure use is not supported with GradScaler (as torch's)")
        if self._stage is _Stage.STEPPED:
            raise MisuseError("step() has already been called since the last update()")
        if self._stage is _Stage.READY:
            self.unscale_(optimizer)
        self._stage = _Stage.STEPPED
        if self._found_inf:
            optimizer.strategy.skip()
            # A scheduler over the prepared optimizer counts this as its step.
            if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
                optimizer._opt_called = True  # type: ignore[attr-defined]
            return None
        return optimizer.step()

    def update(self, new_scale: float | None = None) -> None:
        """Adjust the scale after ``step``: back off after inf or NaN, grow after
        ``growth_interval`` clean steps; or set ``new_scale``."""
        if not self._enabled:
            return
        if new_scale is not None:
            if not float(new_scale) > 0:
                raise InvalidOptionError(f"new_scale must be > 0, got {new_scale}")
            self._scale = float(new_scale)
        else:
            if self._stage is not _Stage.STEPPED:
                raise MisuseError("update() without step() since the last update()")
            if self._found_inf:
                self._scale *= self._backoff_factor
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    self._scale *= self._growth_factor
                    self._growth_tracker = 0
        self._stage = _Stage.READY
        self._found_inf = False

    # state -------------------------------------------------------------------------

    def get_scale(self) -> float:
        """The current scale (1.0 when disabled, as torch's)."""
        return self._scale if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self._growth_factor

    def get_backoff_factor(self) -> float:
        return self._backoff_factor

    def get_growth_interval(self) -> int:
        return self._growth_interval

    def is_enabled(self) -> bool:
        return self._enabled

    def state_dict(self) -> dict[str, Any]:
        """torch's format; empty when disabled (as torch's)."""
        if not self._enabled:
            return {}
        return {
            "scale": self._scale,
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise InvalidOptionError("the state dict is empty: it was written by a disabled scaler")
        self._scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])

    def _check_optimizer(self, optimizer: Any) -> None:
        if optimizer is not self.optimizer:
            raise WrongTypeError(
                "this GradScaler was made for another optimizer; pass the prepared optimizer "
                "it was made with (one scaler per prepared optimizer)"
            )

    def __repr__(self) -> str:
        return (
            f"GradScaler(scale={self.get_scale()}, enabled={self._enabled}, "
            f"strategy={self.optimizer.strategy.name!r})"
        )
