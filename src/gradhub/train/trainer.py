"""DataParallelTrainer: the data-parallel front of gradhub.

For now it carries the two pure pieces of DESIGN 4, :meth:`split_batch` and
:meth:`merge_worker_updates` (which need no model). The training-job API of
DESIGN 7 (``DataParallelTrainer(model, optimizer, strategy=...)`` with
``fit(...)``) extends this class; its constructor already accepts and stores
those arguments so that code written against it keeps working.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gradhub.merge import ModelUpdate, WorkerUpdate, merge_worker_updates, split_batch


class DataParallelTrainer:
    """Splits batches across workers and merges their updates.

    Args:
        model: the ``torch.nn.Module`` to train (not needed for split/merge).
        optimizer: its optimizer (not needed for split/merge).
        strategy: how a training job synchronises (DESIGN 7); stored.
        **options: further strategy options; stored in :attr:`options`.
    """

    def __init__(
        self,
        model: Any = None,
        optimizer: Any = None,
        *,
        strategy: str = "allreduce",
        **options: Any,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.strategy = strategy
        self.options = options

    @staticmethod
    def split_batch(data: Any, n_workers: int) -> list[Any]:
        """Round-robin split into ``n_workers`` parts; see :func:`gradhub.merge.split_batch`."""
        return split_batch(data, n_workers)

    @staticmethod
    def merge_worker_updates(updates: Sequence[WorkerUpdate]) -> ModelUpdate:
        """Sample-weighted merge; see :func:`gradhub.merge.merge_worker_updates`."""
        return merge_worker_updates(updates)

    def __repr__(self) -> str:
        model = type(self.model).__name__ if self.model is not None else None
        return f"DataParallelTrainer(model={model}, strategy={self.strategy!r})"
