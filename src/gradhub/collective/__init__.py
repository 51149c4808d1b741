"""Collectives: reduce-scatter/all-gather/all-reduce, AllReduceParameter, ShardedOptimizer.

- :mod:`.collectives`: :func:`reduce_scatter`, :func:`all_gather`, :func:`all_reduce`
  on the group's transport (:mod:`gradhub.transports`).
- :mod:`.allreduce_parameter`: :class:`AllReduceParameter` (BigDL's).
- :mod:`.sharded_optimizer`: :class:`ShardedOptimizer` (ZeRO-1).
- :mod:`.staging`: CUDA tensors through pinned host buffers, for a group
  whose transports carry host memory (gloo).

Re-exported here: :class:`CollectiveGroup` and :class:`CollectiveFuture`
(:mod:`gradhub.transports.group`) and the set-up functions of :mod:`gradhub.runtime`.
"""

from gradhub.collective.allreduce_parameter import AllReduceParameter
from gradhub.collective.collectives import all_gather, all_reduce, reduce_scatter
from gradhub.collective.sharded_optimizer import ShardedOptimizer
from gradhub.runtime import (
    DEFAULT_TIMEOUT,
    destroy_process_group,
    free_loopback_port,
    init_process_group_from_env,
    local_group,
)
from gradhub.transports.group import CollectiveFuture, CollectiveGroup

__all__ = [
    "DEFAULT_TIMEOUT",
    "AllReduceParameter",
    "CollectiveFuture",
    "CollectiveGroup",
    "ShardedOptimizer",
    "all_gather",
    "all_reduce",
    "destroy_process_group",
    "free_loopback_port",
    "init_process_group_from_env",
    "local_group",
    "reduce_scatter",
]
