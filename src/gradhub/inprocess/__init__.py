"""The in-process pieces: training with threads in one process, no process group.

- :mod:`.coordinator`: :class:`DistributedGradientsCoordinator`, which worker
  threads add gradients to and one thread applies, first in, first out.
- :mod:`.merge`: :func:`split_batch` (a batch's round-robin shares, one per
  worker) and :func:`merge_worker_updates` (the workers' gradients averaged,
  weighted by the samples each processed), what
  :class:`~gradhub.DataParallelTrainer` offers without a model.

All of it is exported by :mod:`gradhub` itself. These modules stand on the
pure top-level modules (``errors``, ``trees``) only.
"""

from gradhub.inprocess.coordinator import DistributedGradientsCoordinator
from gradhub.inprocess.merge import ModelUpdate, WorkerUpdate, merge_worker_updates, split_batch

__all__ = [
    "DistributedGradientsCoordinator",
    "ModelUpdate",
    "WorkerUpdate",
    "merge_worker_updates",
    "split_batch",
]
