"""FitConfig and FitResult: how one call of ``DataParallelTrainer.fit`` runs, and
what it did (:mod:`gradhub.train.fit` runs it; :mod:`gradhub.train.trainer` is the
public front)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gradhub.errors import InvalidOptionError, WrongTypeError
from gradhub.train.losses import Metric

__all__ = ["METRIC_NAMES", "FitConfig", "FitResult", "StepCallback"]

StepCallback = Callable[[int, dict[str, Any]], None]
METRIC_NAMES = ("accuracy", "loss")
"""The metrics ``fit`` knows by name (``FitConfig.metrics``)."""


@dataclass(kw_only=True)
class FitConfig:
    """How :meth:`DataParallelTrainer.fit` runs."""

    epochs: int = 1
    """Passes over the training data."""
    batch_size: int = 64
    """Global batch size, split round-robin over the ranks (>= number of ranks)."""
    seed: int = 0
    """Seeds the per-epoch shuffle; the same on every rank."""
    shuffle: bool = True
    """Shuffle the training data each epoch."""
    run_dir: Path | None = None
    """Folder for metrics (JSON lines per rank); ``None`` writes none."""
    checkpoint_dir: Path | None = None
    """Folder for checkpoints; ``None`` writes none, unless the job can restart
    (see ``resume_on_restart``): then ``run_dir/checkpoints``."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps; 0 means at the end of each epoch."""
    resume: bool = False
    """Continue from the latest checkpoint every rank has (fresh start if none)."""
    resume_on_restart: bool = True
    """When torchrun may restart the workers (``gradhub run --max-restarts N``,
    N > 0): checkpoint, and let restarted workers resume from the latest
    checkpoint every rank has. ``False``: no automatic checkpoints, and a
    restarted worker starts over from step 0 (torchrun's plain behaviour)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    log_every: int = 1
    """Write a step record every this many steps."""
    eval_batch_size: int | None = None
    """Global batch size of evaluation; ``None``: ``batch_size``."""
    grad_clip: float | None = None
    """Clip the combined gradient to this global norm before each step."""
    accumulate: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    lr_scheduler: Any = None
    """An LR scheduler over the trainer's optimizer, or ``optimizer -> scheduler``."""
    scheduler_interval: str = "step"
    """Step the scheduler after every optimizer ``"step"`` or every ``"epoch"``."""
    precision: str = "fp32"
    """``"fp32"``; ``"bf16"`` (forward and loss under autocast in bfloat16); or
    ``"fp16"`` (autocast in float16 with dynamic loss scaling by
    :class:`gradhub.GradScaler`, a step skipped for an overflow skipped on
    every rank that shares it). Parameters, gradients and the optimizer stay
    fp32; on every device (CPU autocast included)."""
    grad_scaler: dict[str, Any] | None = None
    """Options of the :class:`gradhub.GradScaler` of ``precision="fp16"``
    (``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``)."""
    metrics: Sequence[str | Metric] = ("accuracy",)
    """What is reported beside the loss, by name or as a callable: ``"accuracy"``
    (where it applies, else ``None``; without it in the list, always ``None``),
    ``"loss"`` (always reported; accepted so a Keras-style list works), and
    callables ``fn(output, batch) -> float`` (a mean over the batch), reported as
    ``train_<name>`` / ``eval_<name>`` after the function's ``__name__``."""

    def __post_init__(self) -> None:
        if self.scheduler_interval not in ("step", "epoch"):
            raise InvalidOptionError(
                f"scheduler_interval is 'step' or 'epoch', got {self.scheduler_interval!r}"
            )
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise InvalidOptionError(
                f"precision is 'fp32', 'bf16' or 'fp16', got {self.precision!r}"
            )
        if self.grad_scaler is not None:
            if self.precision != "fp16":
                raise InvalidOptionError(
                    f"grad_scaler options apply to precision='fp16' only, got "
                    f"precision={self.precision!r}\n- help: bf16 and fp32 need no loss "
                    "scaling; drop grad_scaler or set precision='fp16'"
                )
            valid = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
            unknown = sorted(set(self.grad_scaler) - set(valid))
            if unknown:
                raise InvalidOptionError(
                    f"unknown grad_scaler option(s): {', '.join(unknown)}\n- help: valid "
                    f"options are {', '.join(valid)}"
                )
        self._check_metrics()
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise InvalidOptionError(f"grad_clip must be > 0, got {self.grad_clip}")
        for name in ("epochs", "batch_size", "log_every", "accumulate"):
            if getattr(self, name) < 1:
                raise InvalidOptionError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise InvalidOptionError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.resume and self.checkpoint_dir is None:
            raise InvalidOptionError("resume=True needs checkpoint_dir")
        self.run_dir = Path(self.run_dir) if self.run_dir is not None else None
        if self.checkpoint_dir is not None:
            self.checkpoint_dir = Path(self.checkpoint_dir)

    def _check_metrics(self) -> None:
        if isinstance(self.metrics, str):
            self.metrics = (self.metrics,)
        names: list[str] = []
        for m in self.metrics:
            if isinstance(m, str):
                if m not in METRIC_NAMES:
                    raise InvalidOptionError(
                        f"unknown metric {m!r}\n- help: valid names are "
                        f"{', '.join(map(repr, METRIC_NAMES))}; or give a callable "
                        "fn(output, batch) -> float"
                    )
                names.append(m)
            elif callable(m):
                name = getattr(m, "__name__", None)
                if not isinstance(name, str) or not name.isidentifier():
                    raise InvalidOptionError(
                        f"metric {m!r} has no name to report it under ({name!r})\n- help: "
                        "define it with `def name(output, batch): ...`: its records are "
                        "train_<name> and eval_<name>"
                    )
                names.append(name)
            else:
                raise WrongTypeError(f"a metric is a name or a callable, got {type(m).__name__}")
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise InvalidOptionError(
                f"metric name(s) {', '.join(repeated)} given more than once (a callable is "
                f"named after its __name__; 'loss' and 'accuracy' are taken)\n- help: give "
                "each metric its own name"
            )


@dataclass
class FitResult:
    """What one call of :meth:`DataParallelTrainer.fit` did (global numbers)."""

    strategy: str
    world_size: int
    start_step: int
    """Step the job started from (> 0 when resumed)."""
    steps: int
    """Step count at the end."""
    train_loss: float
    train_accuracy: float | None
    eval_loss: float | None
    eval_accuracy: float | None
    wall_time: float
    """Seconds spent in the training loop of this call."""
    samples_per_s: float
    """Global training samples per second over this call."""
    restarts: int = 0
    """Times torchrun restarted the job's workers before this attempt
    (``TORCHELASTIC_RESTART_COUNT``)."""
    failures: int = 0
    """Workers that died during this call while the others went on
    (``gradhub run --survive``)."""
    redone: int = 0
    """Steps a death interrupted on this rank, each trained again over the survivors."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """One record per epoch."""
