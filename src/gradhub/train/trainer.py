"""DataParallelTrainer: split/merge (no model needed) and whole training jobs.

Two faces of one class (DESIGN 4 and 7):

- ``DataParallelTrainer().split_batch(data, n)`` and
  ``.merge_worker_updates(updates)``: the pure pieces, no model or process group.
- ``DataParallelTrainer(model, optimizer, strategy="allreduce").fit(...)``,
  run in every process of a job (``gradhub run -n N script.py`` or torchrun).

How ``fit`` splits the data: every epoch all ranks draw the same permutation
(from ``seed`` and the epoch number), cut it into global batches of
``batch_size`` samples, and split each global batch round-robin with
:func:`~gradhub.merge.split_batch`; rank r trains on part r. The strategy
weights each rank's gradient by its samples, so a step equals one
single-process step on the whole global batch, and the last, short batch is
exact too.

Decisions where the design was silent:
- ``batch_size`` is the *global* batch size (what a single process would use);
  smaller than the number of ranks is an error before any work.
- A resumed job continues at the step after the latest checkpoint that every
  rank has (data order depends only on seed, epoch and step, so the same
  batches follow). Random state of the model itself (dropout) is not restored.
- Evaluation splits ``eval_data`` across ranks and sums counts with one
  all-reduce per epoch; every rank logs the same global numbers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from gradhub.merge import ModelUpdate, WorkerUpdate, merge_worker_updates, split_batch
from gradhub.runtime import Runtime, init
from gradhub.train.checkpoint import CheckpointDir, common_step
from gradhub.train.logs import rank_logger
from gradhub.train.metrics import MetricsWriter
from gradhub.train.strategies import Strategy, check_name, make_strategy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
StepCallback = Callable[[int, dict[str, Any]], None]


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
    """Folder for checkpoints; ``None`` writes none."""
    checkpoint_every: int = 0
    """Checkpoint every this many steps; 0 means at the end of each epoch."""
    resume: bool = False
    """Continue from the latest checkpoint every rank has (fresh start if none)."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    log_every: int = 1
    """Write a step record every this many steps."""

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume=True needs checkpoint_dir")
        self.run_dir = Path(self.run_dir) if self.run_dir is not None else None
        if self.checkpoint_dir is not None:
            self.checkpoint_dir = Path(self.checkpoint_dir)


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
    history: list[dict[str, Any]] = field(default_factory=list)
    """One record per epoch."""


def _as_columns(data: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(data, "tensors"):  # torch.utils.data.TensorDataset
        data = tuple(data.tensors)
    if not (isinstance(data, (tuple, list)) and len(data) == 2):
        raise TypeError(f"{what} must be a pair (inputs, targets) of tensors or NumPy arrays")
    cols = [
        torch.from_numpy(np.ascontiguousarray(c)) if isinstance(c, np.ndarray) else c for c in data
    ]
    if not all(isinstance(c, torch.Tensor) for c in cols):
        raise TypeError(f"{what} must be a pair (inputs, targets) of tensors or NumPy arrays")
    if cols[0].shape[0] != cols[1].shape[0] or cols[0].shape[0] == 0:
        raise ValueError(
            f"{what}: inputs and targets need the same, non-zero number of samples, "
            f"got {cols[0].shape[0]} and {cols[1].shape[0]}"
        )
    return cols[0], cols[1]


class DataParallelTrainer:
    """Splits batches and merges updates; with a model, runs training jobs.

    Args:
        model: the ``torch.nn.Module`` to train (not needed for split/merge).
        optimizer: its optimizer. For ``allreduce`` it runs locally on every
            rank; ``sharded`` steps it on each rank's slice only (ZeRO-1); the
            parameter-server strategies use it to configure the servers.
        strategy: ``"allreduce"``, ``"sharded"``, ``"ps-async"``, ``"ps-sync"``,
            ``"ps-ssp"``, or a :class:`~gradhub.train.strategies.Strategy`.
        runtime: from :func:`gradhub.init`; ``fit`` calls it when omitted.
        **options: options of the strategy (e.g. ``bucket_mb=``, ``compress=``).
    """

    def __init__(
        self,
        model: Any = None,
        optimizer: Any = None,
        *,
        strategy: str | Strategy = "allreduce",
        runtime: Runtime | None = None,
        **options: Any,
    ) -> None:
        if isinstance(strategy, str):
            check_name(strategy)
        elif options:
            raise TypeError("options go to the strategy's constructor, not with an instance")
        self.model = model
        self.optimizer = optimizer
        self.strategy = strategy if isinstance(strategy, str) else strategy.name
        self.options = options
        self.runtime = runtime
        self._owns_runtime = False
        self._impl: Strategy | None = None if isinstance(strategy, str) else strategy

    # split and merge (DESIGN 4) -------------------------------------------------------

    @staticmethod
    def split_batch(data: Any, n_workers: int) -> list[Any]:
        """Round-robin split into ``n_workers`` parts; see :func:`gradhub.merge.split_batch`."""
        return split_batch(data, n_workers)

    @staticmethod
    def merge_worker_updates(updates: Sequence[WorkerUpdate]) -> ModelUpdate:
        """Sample-weighted merge; see :func:`gradhub.merge.merge_worker_updates`."""
        return merge_worker_updates(updates)

    # training jobs (DESIGN 7) ---------------------------------------------------------

    def _prepare(self) -> tuple[Runtime, Strategy]:
        if self.model is None:
            raise ValueError("fit() needs DataParallelTrainer(model, optimizer, strategy=...)")
        if self._impl is None:
            self._impl = make_strategy(self.strategy, **self.options)
        if self.runtime is None:
            self.runtime = init()
            self._owns_runtime = True
        if self._impl._runtime is None:
            self.model.to(self.runtime.device)
            self._impl.setup(self.model, self.optimizer, self.runtime)
        return self.runtime, self._impl

    def fit(
        self,
        train_data: Any,
        *,
        eval_data: Any = None,
        loss_fn: LossFn | None = None,
        on_step: StepCallback | None = None,
        config: FitConfig | None = None,
        **settings: Any,
    ) -> FitResult:
        """Train on ``train_data`` = (inputs, targets); run in every process of the job.

        ``settings`` are :class:`FitConfig` fields (``epochs=``, ``batch_size=``,
        ``run_dir=``, ``checkpoint_dir=``, ``resume=``, ...). ``loss_fn(output,
        target)`` returns a mean loss (cross-entropy by default). ``on_step(step,
        record)`` is called after every step.
        """
        if config is not None and settings:
            raise TypeError("pass either config= or keyword settings, not both")
        unknown = set(settings) - {f.name for f in fields(FitConfig)}
        if unknown:
            raise TypeError(f"unknown fit setting(s): {', '.join(sorted(unknown))}")
        cfg = config or FitConfig(**settings)
        x_train, y_train = _as_columns(train_data, "train_data")
        evals = _as_columns(eval_data, "eval_data") if eval_data is not None else None
        runtime, strategy = self._prepare()
        if cfg.batch_size < runtime.world_size:
            raise ValueError(self._batch_error(cfg.batch_size, runtime.world_size))
        return _Fit(self, runtime, strategy, cfg, loss_fn or torch.nn.functional.cross_entropy)(
            x_train, y_train, evals, on_step
        )

    @staticmethod
    def _batch_error(batch_size: int, world: int) -> str:
        return (
            f"batch size {batch_size} is smaller than the number of workers ({world}): "
            f"some workers would never get data\n- help: use a batch size >= {world}"
        )

    def close(self) -> None:
        """Close the strategy and, if ``fit`` created it, the runtime. Idempotent."""
        if self._impl is not None:
            self._impl.close()
        if self._owns_runtime and self.runtime is not None:
            self.runtime.close()

    def __enter__(self) -> DataParallelTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        model = type(self.model).__name__ if self.model is not None else None
        return f"DataParallelTrainer(model={model}, strategy={self.strategy!r})"


class _Fit:
    """One call of ``fit``: the loop, metrics, evaluation and checkpoints."""

    def __init__(
        self,
        trainer: DataParallelTrainer,
        runtime: Runtime,
        strategy: Strategy,
        cfg: FitConfig,
        loss_fn: LossFn,
    ) -> None:
        self.model: torch.nn.Module = trainer.model
        self.rt, self.strategy, self.cfg, self.loss_fn = runtime, strategy, cfg, loss_fn
        self.log = rank_logger(__name__, runtime.rank)
        self.metrics = MetricsWriter(cfg.run_dir, runtime.rank)
        self.ckpt = (
            CheckpointDir(path=cfg.checkpoint_dir, rank=runtime.rank)
            if cfg.checkpoint_dir is not None
            else None
        )

    def __call__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        evals: tuple[torch.Tensor, torch.Tensor] | None,
        on_step: StepCallback | None,
    ) -> FitResult:
        try:
            return self._run(x, y, evals, on_step)
        finally:
            self.metrics.close()

    def _batches(self, n: int, epoch: int) -> list[torch.Tensor]:
        if self.cfg.shuffle:
            g = torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch)
            order = torch.randperm(n, generator=g)
        else:
            order = torch.arange(n)
        return list(order.split(self.cfg.batch_size))

    def _resume(self) -> int:
        if not (self.cfg.resume and self.ckpt is not None):
            return 0
        mine = self.ckpt.steps()
        everyone: list[list[int]] = [[] for _ in range(self.rt.world_size)]
        if self.rt.world_size > 1:
            dist.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        step = common_step(everyone)
        if step is None:
            self.log.info("no checkpoint that every rank has in %s: starting fresh", self.ckpt.path)
            return 0
        state = self.ckpt.load(step)
        if state.get("world_size") != self.rt.world_size and self.strategy.name == "sharded":
            raise ValueError(
                f"checkpoint of step {step} was written by {state.get('world_size')} ranks, "
                f"this job has {self.rt.world_size}; sharded optimizer state cannot be re-split"
            )
        self.model.load_state_dict(state["model"])
        self.strategy.load_state_dict(state["strategy"])
        self.log.info("resumed from step %d (%s)", step, self.ckpt.file(step))
        return step

    def _save(self, step: int) -> None:
        if self.ckpt is None:
            return
        self.strategy.refresh()
        state = {
            "world_size": self.rt.world_size,
            "model": self.model.state_dict(),
            "strategy": self.strategy.state_dict(),
        }
        path = self.ckpt.save(step, state)
        self.log.debug("checkpoint of step %d written to %s", step, path)

    def _evaluate(self, data: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """Local [loss sum, correct, count] on this rank's share of ``data``."""
        out = torch.zeros(3, dtype=torch.float64)
        if data is None:
            return out
        x, y = data
        mine = split_batch(torch.arange(x.shape[0]), self.rt.world_size)[self.rt.rank]
        self.strategy.refresh()
        self.model.eval()
        with torch.no_grad():
            for chunk in mine.split(1024):
                xb, yb = x[chunk].to(self.rt.device), y[chunk].to(self.rt.device)
                output = self.model(xb)
                out[0] += float(self.loss_fn(output, yb)) * len(chunk)
                out[1] += _correct(output, yb)
                out[2] += len(chunk)
        self.model.train()
        return out

    def _run(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        evals: tuple[torch.Tensor, torch.Tensor] | None,
        on_step: StepCallback | None,
    ) -> FitResult:
        rt, cfg = self.rt, self.cfg
        n = x.shape[0]
        per_epoch = math.ceil(n / cfg.batch_size)
        total = per_epoch * cfg.epochs
        start = self._resume()
        step = start
        self.model.train()
        bar = tqdm(
            total=total,
            initial=start,
            disable=not (cfg.progress and rt.is_main),
            desc=f"{self.strategy.name} x{rt.world_size}",
            unit="step",
            leave=False,
        )
        history: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        global_seen = 0
        stats = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count (this epoch)
        try:
            for epoch in range(start // per_epoch, cfg.epochs):
                batches = self._batches(n, epoch)
                first = start - epoch * per_epoch if epoch == start // per_epoch else 0
                stats.zero_()
                for b in range(first, per_epoch):
                    record = self._step(x, y, batches[b], stats)
                    step += 1
                    global_seen += len(batches[b])
                    elapsed = time.perf_counter() - t0
                    record.update(step=step, epoch=epoch, samples_per_s=global_seen / elapsed)
                    if step % cfg.log_every == 0:
                        self.metrics.write("step", **record)
                    bar.update(1)
                    if bar.disable is False:
                        bar.set_postfix(
                            refresh=False,
                            loss=f"{record['loss']:.3f}",
                            samples_s=f"{record['samples_per_s']:.0f}",
                        )
                    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                        self._save(step)
                    if on_step is not None:
                        on_step(step, record)
                history.append(self._end_epoch(epoch, step, stats, evals, t0, global_seen))
                if not cfg.checkpoint_every:
                    self._save(step)
        finally:
            bar.close()
        wall = time.perf_counter() - t0
        last = history[-1] if history else {}
        result = FitResult(
            strategy=self.strategy.name,
            world_size=rt.world_size,
            start_step=start,
            steps=step,
            train_loss=last.get("train_loss", math.nan),
            train_accuracy=last.get("train_accuracy"),
            eval_loss=last.get("eval_loss"),
            eval_accuracy=last.get("eval_accuracy"),
            wall_time=wall,
            samples_per_s=global_seen / wall if wall > 0 else 0.0,
            history=history,
        )
        self.metrics.write("summary", **{k: v for k, v in asdict(result).items() if k != "history"})
        return result

    def _step(
        self, x: torch.Tensor, y: torch.Tensor, batch: torch.Tensor, stats: torch.Tensor
    ) -> dict[str, Any]:
        mine = split_batch(batch, self.rt.world_size)[self.rt.rank]
        xb, yb = x[mine].to(self.rt.device), y[mine].to(self.rt.device)
        seen: dict[str, float] = {}

        def closure() -> torch.Tensor:
            output = self.model(xb)
            loss = self.loss_fn(output, yb)
            seen["loss"] = float(loss.detach())
            seen["correct"] = _correct(output.detach(), yb)
            return loss

        self.strategy.step(closure, len(mine), len(batch))
        samples = len(mine)
        if samples:
            stats += torch.tensor([seen["loss"] * samples, seen["correct"], samples])
        return {
            "loss": seen.get("loss", math.nan),
            "accuracy": seen["correct"] / samples if samples else None,
            "samples": samples,
        }

    def _end_epoch(
        self,
        epoch: int,
        step: int,
        stats: torch.Tensor,
        evals: tuple[torch.Tensor, torch.Tensor] | None,
        t0: float,
        global_seen: int,
    ) -> dict[str, Any]:
        both = torch.cat([stats, self._evaluate(evals)])
        self.rt.all_reduce_sum(both, where=f"evaluation after epoch {epoch}")
        tl, tc, tn, el, ec, en = both.tolist()
        record: dict[str, Any] = {
            "epoch": epoch,
            "step": step,
            "train_loss": tl / tn if tn else math.nan,
            "train_accuracy": tc / tn if tn else None,
            "eval_loss": el / en if en else None,
            "eval_accuracy": ec / en if en else None,
            "samples_per_s": global_seen / max(time.perf_counter() - t0, 1e-9),
        }
        self.metrics.write("epoch", **record)
        acc = record["eval_accuracy"]
        self.log.info(
            "epoch %d step %d: train loss %.4f%s",
            epoch,
            step,
            record["train_loss"],
            f", eval accuracy {acc:.4f}" if acc is not None else "",
        )
        return record


def _correct(output: torch.Tensor, target: torch.Tensor) -> float:
    """Correct predictions for classification outputs (N, C) vs. integer targets, else 0."""
    if output.ndim == 2 and not target.is_floating_point() and target.ndim == 1:
        return float((output.argmax(dim=1) == target).sum())
    return 0.0
