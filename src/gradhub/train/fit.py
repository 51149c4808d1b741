"""One call of ``DataParallelTrainer.fit``: the user's own loop, written once.

``fit`` is built on :func:`gradhub.prepare`: it runs exactly the loop a user
would write (``zero_grad``, forward, ``backward`` under ``no_sync`` for all
micro-batches but the last, clip, ``step``, scheduler) on the prepared model
and optimizer, so ``fit`` and an own loop share one code path.

The loop, checkpoints and metrics files (decisions; what a batch, a loss and a
metric are: :mod:`gradhub.train.losses`; the settings: :mod:`gradhub.train.fit_config`):
- ``accumulate=k``: each step runs ``k`` consecutive batches, each loss
  weighted by its share of the step's samples; the optimizer steps once.
- ``lr_scheduler``: a scheduler over the optimizer given to the trainer, or
  a callable ``optimizer -> scheduler``; stepped after every optimizer step
  (``scheduler_interval="step"``, the default) or after every epoch.
- ``precision="bf16"``: forward and loss under ``torch.autocast`` in
  bfloat16 (parameters, gradients and the optimizer stay fp32), on CPU and
  CUDA. ``precision="fp16"``: the same in float16, with dynamic loss scaling
  by :class:`gradhub.GradScaler` (the class an own loop uses; options from
  ``grad_scaler=``): the loss is scaled before ``backward``; with
  ``grad_clip`` the combined gradient is unscaled first, then clipped (torch's
  AMP recipe); a step whose gradient overflowed is skipped on every rank
  that shares it (see :mod:`gradhub.train.grad_scaler`). A skipped step
  counts as a step (the step count, ``log_every``, checkpoints and a
  per-step LR scheduler go on as for any step); step records carry
  ``loss_scale`` (the scale the step used) and ``skipped``. The scaler's
  state is in the checkpoints and is restored on resume.
- A run folder that already has metrics is an error unless ``resume=True``
  (then the metrics continue the same files): a new run goes in a new folder.
  The error (:class:`~gradhub.errors.RunFolderExistsError`) comes on every rank
  and on every attempt of a job the agent restarts, unless an earlier attempt
  of the same job started the folder (below).
- A resumed job that had already finished returns the metrics of its last
  epoch (stored in the checkpoint), not NaN.
- ``resume=True`` continues from the latest checkpoint that every rank of the
  job that wrote it finished, also at another world size (a 2-rank job's
  checkpoint resumed by 3 ranks): each file holds the model and the full
  optimizer state, and ``batch_size`` is global, so the remaining steps see
  the same global batches.

Restarts (torchrun's elastic agent, ``gradhub run --max-restarts N``):
- When the agent may restart the workers (``TORCHELASTIC_MAX_RESTARTS`` > 0),
  checkpoints are on by default: into ``checkpoint_dir``, or
  ``run_dir/checkpoints`` when none is given, at the end of every epoch (or
  every ``checkpoint_every`` steps).
- A restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes as with
  ``resume=True``, and continues the metrics files, where an earlier attempt
  of this job started the run folder (a key in the store torchrun's agent
  keeps for the job). Newer checkpoint files
  (written before the failure by some ranks only) are deleted, so a later
  restart cannot mix them with the files written again.
- Under ``ps-*`` the servers hold the parameters and the optimizer state, and
  they kept running: a restarted worker takes from the checkpoint only the
  step (and the LR scheduler), then pulls the servers' current values, so
  nothing a server acknowledged is lost. The steps after the checkpoint are
  trained again; their pushes are new pushes.
- Every rank's metrics get a ``{"kind": "restart", "restart": k, "step": s}``
  record (``s``: the step resumed from), and ``FitResult.restarts`` (in the
  summary record) counts the restarts.
- With ``resume_on_restart=False``, or without ``run_dir`` and
  ``checkpoint_dir``, a restarted worker starts over from step 0, as a
  plain script under torchrun does; rank 0 logs a warning saying so.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm import tqdm

from gradhub.errors import RunFolderExistsError
from gradhub.train import fit_survival as survival
from gradhub.train.checkpoint import CheckpointDir, agreed_checkpoint
from gradhub.train.data import Source, Step, to_device
from gradhub.train.fit_config import FitConfig, FitResult
from gradhub.train.grad_scaler import GradScaler
from gradhub.train.logs import rank_logger
from gradhub.train.losses import LossFn, Metric, Stats, detach, inputs_of
from gradhub.train.metrics import MetricsWriter, metrics_file
from gradhub.transports.stores import job_store

if TYPE_CHECKING:
    from gradhub.runtime import Runtime
    from gradhub.runtime.membership import Regrouped
    from gradhub.train.distributed_optimizer import DistributedOptimizer
    from gradhub.train.wrapped_model import PreparedModel


class FitRun:
    """The loop, metrics, evaluation and checkpoints of one ``fit`` call."""

    def __init__(
        self,
        model: PreparedModel,
        optimizer: DistributedOptimizer,
        runtime: Runtime,
        cfg: FitConfig,
        loss_fn: LossFn,
        scheduler: Any,
    ) -> None:
        self.model, self.opt, self.rt, self.cfg = model, optimizer, runtime, cfg
        # Batches go where the model is (gradhub.prepare moves nothing).
        first = next(model.module.parameters(), None)
        self.device = first.device if first is not None else runtime.device
        self.loss_fn, self.scheduler = loss_fn, scheduler
        self.strategy = model.strategy
        self.log = rank_logger(__name__, runtime.rank)
        named = [
            (m, m) if isinstance(m, str) else (getattr(m, "__name__", "metric"), m)
            for m in cfg.metrics
        ]
        self.metric_fns: dict[str, Metric] = {n: fn for n, fn in named if not isinstance(fn, str)}
        self.accuracy = "accuracy" in cfg.metrics
        folder, self.resuming = self._checkpoint_plan()
        self._check_run_dir()
        self.metrics = MetricsWriter(cfg.run_dir, survival.member_of(runtime))
        self.ckpt = CheckpointDir(path=folder, rank=runtime.rank) if folder is not None else None
        half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        self.autocast = (
            torch.autocast(self.device.type, dtype=half)
            if half is not None
            else contextlib.nullcontext()
        )
        self.scaler = (
            GradScaler(optimizer, **(cfg.grad_scaler or {})) if cfg.precision == "fp16" else None
        )

    def _checkpoint_plan(self) -> tuple[Path | None, bool]:
        """(checkpoint folder or ``None``, whether to resume): see "Restarts" above."""
        cfg, rt = self.cfg, self.rt
        folder = cfg.checkpoint_dir
        if rt.max_restarts == 0 or not cfg.resume_on_restart:
            if rt.max_restarts and rt.is_main:
                self.log.warning(
                    "resume_on_restart=False: a restarted worker starts over from step 0"
                )
            return folder, cfg.resume
        if folder is None and cfg.run_dir is not None:
            folder = cfg.run_dir / "checkpoints"
        if folder is None and rt.is_main:
            self.log.warning(
                "torchrun may restart this job (max %d restarts) but fit() has neither "
                "run_dir nor checkpoint_dir: a restarted worker starts over from step 0",
                rt.max_restarts,
            )
        return folder, cfg.resume or (rt.restart > 0 and folder is not None)

    def _check_run_dir(self) -> None:
        """A run folder that holds a run is refused unless ``resume=True``. A
        restarted worker continues the metrics only where an earlier attempt of
        this job started them (noted in the job's store): a second job into the
        folder of a finished one is refused on every attempt, not resumed."""
        if self.rt.replacement:  # joins a running job, whose run this folder holds
            return
        run_dir, used = self.cfg.run_dir, 0.0
        jobs = job_store(self.rt.store)
        started = f"fit/started/{run_dir.resolve()}" if run_dir is not None else ""
        continued = self.rt.restart > 0 and run_dir is not None and jobs.check([started])
        if run_dir is not None and not self.cfg.resume and not continued:
            used = float(any(metrics_file(run_dir, r).exists() for r in range(self.rt.world_size)))
        flag = survival.surviving_sum(self.rt, torch.tensor([used]), "run folder check")
        if flag.item() > 0:
            raise RunFolderExistsError(
                f"run folder {run_dir} already holds the metrics of a run\n"
                "- help: give a new run_dir, or resume=True (with checkpoint_dir) to continue it"
            )
        if run_dir is not None:
            jobs.set(started, "1")

    # checkpoints -------------------------------------------------------------------

    def resume(self) -> tuple[int, dict[str, Any]]:
        if not (self.resuming and self.ckpt is not None):
            return 0, {}
        found = agreed_checkpoint(self.rt, self.ckpt)
        self.ckpt.discard_after(found[0] if found is not None else 0)
        if found is None:
            self.log.info("no complete checkpoint in %s: starting fresh", self.ckpt.path)
            return 0, {}
        step, written_by = found
        # Every file holds the whole state: another world size reads the files it has.
        state = self.ckpt.load(step, rank=self.rt.rank % written_by)
        if self.rt.restart and self.strategy.state_outlives_workers:
            # The servers kept running: their values and optimizer state hold every
            # update acknowledged since this checkpoint. Take those, not the file's;
            # only the script's hyperparameters (an LR scheduler's lr) come from it.
            saved = state.get("optimizer", {}).get("param_groups", [])
            for live, old in zip(self.opt.param_groups, saved, strict=False):
                live.update({k: v for k, v in old.items() if k != "params"})
            self.strategy.refresh()
        else:
            self.model.load_state_dict(state["model"])
            if "optimizer" in state:
                self.opt.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.strategy.steps = step
        self.log.info(
            "resumed from step %d (%s, written by %d rank(s))",
            step,
            self.ckpt.file(step, self.rt.rank % written_by),
            written_by,
        )
        return step, dict(state.get("last") or {})

    def save(self, step: int, last: dict[str, Any]) -> None:
        if self.ckpt is None:
            return
        state = {
            "world_size": self.rt.world_size,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),  # a collective under 'sharded'
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "last": last,
        }
        path = self.ckpt.save(step, state)
        self.log.debug("checkpoint of step %d written to %s", step, path)

    def _regrouped(self, done: Regrouped) -> None:
        """After a death: the lowest live rank takes rank 0's duties, files keep their names."""
        if self.ckpt is not None:
            self.ckpt.rank = self.rt.rank
        self.metrics.write("membership", **survival.membership_record(done))

    # one step ------------------------------------------------------------------------

    def _forward(self, batch: Any) -> tuple[Any, torch.Tensor]:
        with self.autocast:
            inputs = inputs_of(batch)
            output = self.model(inputs)
            return output, self.loss_fn(output, batch)

    def step(self, micro: list[Step], stats: Stats) -> dict[str, Any]:
        """One optimizer step over the micro-batches ``micro`` (this rank's parts)."""
        local = sum(s.samples for s in micro)
        known = all(s.global_samples is not None for s in micro)
        total = sum(s.global_samples or 0 for s in micro) if known else None
        self.model.set_samples(local, total)
        self.opt.zero_grad()
        last = max((i for i, s in enumerate(micro) if s.samples), default=-1)
        loss_sum = 0.0
        for i, s in enumerate(micro):
            if not s.samples:
                continue
            batch = to_device(s.batch, self.device)
            quiet = self.model.no_sync() if i != last else contextlib.nullcontext()
            with quiet:
                output, loss = self._forward(batch)
                share = loss * (s.samples / local)
                (share if self.scaler is None else self.scaler.scale(share)).backward()
            value = float(loss.detach())
            loss_sum += value * s.samples
            stats.add(detach(output), batch, value, s.samples)
        if last < 0:
            self.strategy.sync_without_backward()
        extra: dict[str, Any] = {}
        if self.scaler is None:
            if self.cfg.grad_clip is not None:
                self.strategy.clip_grad_norm_(self.cfg.grad_clip)
            self.opt.step()
        else:
            if self.cfg.grad_clip is not None:
                self.scaler.unscale_(self.opt)  # clip the true gradient, not the scaled one
                self.strategy.clip_grad_norm_(self.cfg.grad_clip)
            skipped = self.strategy.skipped_steps
            extra["loss_scale"] = self.scaler.get_scale()
            self.scaler.step(self.opt)
            self.scaler.update()
            extra["skipped"] = self.strategy.skipped_steps > skipped
        if self.scheduler is not None and self.cfg.scheduler_interval == "step":
            self.scheduler.step()
        return {"loss": loss_sum / local if local else None, "samples": local, **extra}

    def evaluate(self, source: Source | None) -> torch.Tensor:
        stats = Stats(self.metric_fns, self.accuracy)
        if source is None:
            return stats.values
        self.strategy.refresh()
        self.model.eval()
        with torch.no_grad():
            for s in source.epoch(0, shuffle=False):
                if s.samples:
                    batch = to_device(s.batch, self.device)
                    output, loss = self._forward(batch)
                    stats.add(detach(output), batch, float(loss), s.samples)
        self.model.train()
        return stats.values

    # the loop ------------------------------------------------------------------------

    def run(
        self,
        train: Source,
        evals: Source | None,
        on_step: Callable[[int, dict[str, Any]], None] | None,
        on_epoch: Callable[[int, dict[str, Any]], None] | None,
        on_eval: Callable[[int, dict[str, Any]], None] | None,
    ) -> FitResult:
        try:
            return self._run(train, evals, on_step, on_epoch, on_eval)
        finally:
            self.metrics.close()

    def _micro_steps(self, source: Source, epoch: int, per_epoch: int) -> Iterator[list[Step]]:
        if self.rt.survive:
            yield from survival.surviving_steps(
                self.rt, source, epoch, per_epoch, self.cfg.accumulate
            )
            return
        batches = source.epoch(epoch)
        while True:
            group = [s for _, s in zip(range(self.cfg.accumulate), batches, strict=False)]
            if not group:
                return
            yield group

    def _run(
        self,
        train: Source,
        evals: Source | None,
        on_step: Any,
        on_epoch: Any,
        on_eval: Any,
    ) -> FitResult:
        rt, cfg = self.rt, self.cfg
        batches = train.steps_per_epoch()
        per_epoch = -(-batches // cfg.accumulate) if batches is not None else None
        start, last = self.resume()
        if rt.survive:
            survival.check_survivable(train, evals, per_epoch)
            start = rt.committed_steps = max(start, rt.committed_steps)  # a replacement's
            rt.on_regroup(self._regrouped)
        if rt.restart:
            self.metrics.write(
                "restart", restart=rt.restart, max_restarts=rt.max_restarts, step=start
            )
            if rt.is_main:
                self.log.warning(
                    "restart %d of at most %d: continuing from step %d",
                    rt.restart,
                    rt.max_restarts,
                    start,
                )
        step = start
        self.model.train()
        bar = tqdm(
            total=per_epoch * cfg.epochs if per_epoch is not None else None,
            initial=start,
            disable=not (cfg.progress and rt.is_main),
            desc=f"{self.strategy.name} x{rt.world_size}",
            unit="step",
            leave=False,
        )
        history: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        seen = 0
        first_epoch = start // per_epoch if per_epoch else 0
        skip = start - first_epoch * per_epoch if per_epoch else start
        try:
            for epoch in range(first_epoch, cfg.epochs):
                stats = Stats(self.metric_fns, self.accuracy)
                for micro in self._micro_steps(train, epoch, per_epoch or 0):
                    if skip and not rt.survive:  # a surviving job's steps start there
                        skip -= 1
                        continue
                    before, failed = stats.values.clone(), self.strategy.failed_steps
                    record = self.step(micro, stats)
                    if self.strategy.failed_steps != failed:
                        stats.values.copy_(before)  # trained again, counted then
                        continue
                    step = rt.committed_steps if rt.survive else step + 1
                    seen += sum(s.samples for s in micro)
                    record.update(
                        step=step,
                        epoch=epoch,
                        samples_per_s=seen * rt.world_size / max(time.perf_counter() - t0, 1e-9),
                    )
                    if step % cfg.log_every == 0:
                        self.metrics.write("step", **record)
                    bar.update(1)
                    if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
                        self.save(step, last)
                    if on_step is not None:
                        on_step(step, record)
                if rt.survive:  # a rank behind may have taken the last step from a peer
                    step = rt.committed_steps
                last = self._end_epoch(epoch, step, stats, evals, on_eval)
                history.append(last)
                if self.scheduler is not None and cfg.scheduler_interval == "epoch":
                    self.scheduler.step()
                if on_epoch is not None:
                    on_epoch(epoch, last)
                if not cfg.checkpoint_every:
                    self.save(step, last)
        finally:
            bar.close()
        wall = time.perf_counter() - t0
        result = FitResult(
            strategy=self.strategy.name,
            world_size=rt.world_size,
            start_step=start,
            steps=step,
            train_loss=last.get("train_loss", math.nan) if last else math.nan,
            train_accuracy=last.get("train_accuracy"),
            eval_loss=last.get("eval_loss"),
            eval_accuracy=last.get("eval_accuracy"),
            wall_time=wall,
            samples_per_s=seen * rt.world_size / wall if wall > 0 and seen else 0.0,
            restarts=rt.restart,
            failures=len(rt.membership.dead) if rt.membership is not None else 0,
            redone=self.strategy.failed_steps,
            history=history,
        )
        summary = {k: v for k, v in vars(result).items() if k != "history"}
        self.metrics.write("summary", **summary)
        return result

    def _end_epoch(
        self, epoch: int, step: int, stats: Stats, evals: Source | None, on_eval: Any
    ) -> dict[str, Any]:
        both = survival.surviving_sum(
            self.rt,
            torch.cat([stats.values, self.evaluate(evals)]),
            f"evaluation after epoch {epoch}",
        )
        half = len(stats.values)
        record: dict[str, Any] = {"epoch": epoch, "step": step}
        train = stats.summary("train_", both[:half])
        train["train_loss"] = train["train_loss"] if train["train_loss"] is not None else math.nan
        record.update(train)
        if evals is not None:
            record.update(stats.summary("eval_", both[half:]))
            if on_eval is not None:
                on_eval(epoch, record)
        else:
            record.update(eval_loss=None, eval_accuracy=None)
        self.metrics.write("epoch", **record)
        self.log.info("epoch %d step %d: train loss %.4f", epoch, step, record["train_loss"])
        return record
