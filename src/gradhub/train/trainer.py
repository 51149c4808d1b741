"""DataParallelTrainer: split/merge (no model needed) and whole training jobs.

Two faces of one class:

- ``DataParallelTrainer().split_batch(data, n)`` and
  ``.merge_worker_updates(updates)``: splitting a batch across workers and the
  sample-weighted merge of their updates, with no model or process group
  (the functions of :mod:`gradhub.inprocess.merge`).
- ``DataParallelTrainer(model, optimizer, strategy="allreduce").fit(...)``:
  a whole training job (a strategy of :mod:`gradhub.train.strategies`,
  checkpoints, metrics), run in every process of the job (``gradhub run -n N
  script.py`` or torchrun).

``fit`` is built on :func:`gradhub.prepare`: the model and optimizer are
prepared once, and every step is the own loop a user would write
(:mod:`gradhub.train.losses` says how batches, losses and metrics are handled;
:mod:`gradhub.train.data` which data it takes and how it is split).

Decisions:
- ``batch_size`` is the *global* batch size (what a single process would use)
  for tensors and datasets; a ``DataLoader`` keeps its own per-rank batch
  size. Smaller than the number of ranks is an error before any work.
- A resumed job continues at the step after the latest checkpoint that every
  rank has (data order depends only on seed, epoch and step, so the same
  batches follow). Random state of the model itself (dropout) is not restored.
- A job that torchrun may restart (``gradhub run --max-restarts N``) resumes
  on its own: see :mod:`gradhub.train.fit`.
- Evaluation splits ``eval_data`` across ranks and sums counts with one
  all-reduce per epoch; every rank logs the same global numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from gradhub.errors import InvalidOptionError, UnsupportedOptionError
from gradhub.inprocess.merge import ModelUpdate, WorkerUpdate, merge_worker_updates, split_batch
from gradhub.runtime import Runtime, init
from gradhub.train.data import Source
from gradhub.train.distributed_optimizer import DistributedOptimizer
from gradhub.train.fit import FitRun
from gradhub.train.fit_config import FitConfig, FitResult, StepCallback
from gradhub.train.losses import LossFn, default_loss
from gradhub.train.prepare import prepare
from gradhub.train.strategies import Strategy, check_name, make_strategy
from gradhub.train.wrapped_model import PreparedModel

__all__ = ["DataParallelTrainer", "FitConfig", "FitResult"]


class DataParallelTrainer:
    """Splits batches and merges updates; with a model, runs training jobs.

    Args:
        model: the ``torch.nn.Module`` to train (not needed for split/merge).
        optimizer: its optimizer. For ``allreduce`` it runs locally on every
            rank; ``sharded`` steps it on each rank's slice only (ZeRO-1); the
            parameter-server strategies use it to configure the servers;
            ``diloco`` steps it locally as the inner optimizer.
        strategy: ``"allreduce"``, ``"sharded"``, ``"ps-async"``, ``"ps-sync"``,
            ``"ps-ssp"``, ``"diloco"``, or a :class:`~gradhub.train.strategies.Strategy`.
        runtime: from :func:`gradhub.init`; ``fit`` calls it when omitted.
        **options: options of the strategy (e.g. ``bucket_mb=``, ``compress=``;
            ``inner_steps=``, ``outer_optimizer=`` under ``diloco``).
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
            raise UnsupportedOptionError(
                "options go to the strategy's constructor, not with an instance"
            )
        self.model = model
        self.optimizer = optimizer
        self.strategy = strategy if isinstance(strategy, str) else strategy.name
        self.options = options
        self.runtime = runtime
        self._owns_runtime = False
        self._impl: Strategy | None = None if isinstance(strategy, str) else strategy
        self._prepared: tuple[PreparedModel, DistributedOptimizer] | None = None

    # split and merge, no model or process group ---------------------------------------

    @staticmethod
    def split_batch(data: Any, n_workers: int) -> list[Any]:
        """Round-robin split into ``n_workers`` parts (sample ``i`` to part ``i % n``);
        see :func:`gradhub.inprocess.merge.split_batch`."""
        return split_batch(data, n_workers)

    @staticmethod
    def merge_worker_updates(updates: Sequence[WorkerUpdate]) -> ModelUpdate:
        """Sample-weighted merge; see :func:`gradhub.inprocess.merge.merge_worker_updates`."""
        return merge_worker_updates(updates)

    # training jobs: fit in every process of the job -----------------------------------

    def _prepare(self) -> tuple[Runtime, PreparedModel, DistributedOptimizer]:
        if self.model is None:
            raise InvalidOptionError(
                "fit() needs DataParallelTrainer(model, optimizer, strategy=...)"
            )
        if self.runtime is None:
            self.runtime = init()
            self._owns_runtime = True
        if self._prepared is None:
            if self._impl is None:
                self._impl = make_strategy(self.strategy, **self.options)
            # fit's ranks run uneven numbers of forwards (no forward in a step without
            # samples, uneven eval shares): buffers follow rank 0 at set-up only.
            self._prepared = prepare(
                self.model,
                self.optimizer,
                strategy=self._impl,
                runtime=self.runtime,
                forward_sync_buffers=False,
            )
        return self.runtime, *self._prepared

    def fit(
        self,
        train_data: Any,
        *,
        eval_data: Any = None,
        loss_fn: LossFn | None = None,
        on_step: StepCallback | None = None,
        on_epoch: StepCallback | None = None,
        on_eval: StepCallback | None = None,
        config: FitConfig | None = None,
        **settings: Any,
    ) -> FitResult:
        """Train on ``train_data``; run in every process of the job.

        ``train_data`` / ``eval_data``: ``(inputs, targets)`` tensors or arrays,
        a ``Dataset``, an ``IterableDataset`` or a ``DataLoader`` (see
        :mod:`gradhub.train.data`). ``settings`` are :class:`FitConfig` fields
        (``epochs=``, ``batch_size=``, ``grad_clip=``, ``accumulate=``,
        ``lr_scheduler=``, ``run_dir=``, ``checkpoint_dir=``, ``resume=``, ...).
        ``loss_fn(output, batch)`` returns a mean loss (default: see
        :mod:`gradhub.train.fit`). ``on_step(step, record)`` is called after every
        step, ``on_epoch(epoch, record)`` after every epoch, ``on_eval(epoch,
        record)`` after every evaluation.
        """
        if config is not None and settings:
            raise UnsupportedOptionError("pass either config= or keyword settings, not both")
        valid = sorted(f.name for f in fields(FitConfig))
        unknown = set(settings) - set(valid)
        if unknown:
            raise UnsupportedOptionError(
                f"unknown fit setting(s): {', '.join(sorted(unknown))}\n- help: valid settings "
                f"are {', '.join(valid)}; and the arguments eval_data, loss_fn, on_step, "
                "on_epoch, on_eval, config"
            )
        cfg = config or FitConfig(**settings)

        def source(data: Any, what: str, batch_size: int) -> Source:
            return Source(
                data, what=what, batch_size=batch_size, seed=cfg.seed, shuffle=cfg.shuffle
            )

        # Data is checked before any process-group work.
        train = source(train_data, "train_data", cfg.batch_size)
        evals = (
            source(eval_data, "eval_data", cfg.eval_batch_size or cfg.batch_size)
            if eval_data is not None
            else None
        )
        rt, model, optimizer = self._prepare()
        if cfg.batch_size < rt.world_size:
            raise InvalidOptionError(self._batch_error(cfg.batch_size, rt.world_size))
        for src in (train, evals):
            if src is not None:
                src.rank, src.world = rt.rank, rt.world_size
        scheduler = cfg.lr_scheduler
        if scheduler is not None and not hasattr(scheduler, "step"):
            scheduler = scheduler(optimizer)
        run = FitRun(model, optimizer, rt, cfg, loss_fn or default_loss, scheduler)
        return run.run(train, evals, on_step, on_epoch, on_eval)

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
