"""Collectives: process groups, ring reduce-scatter/all-gather, AllReduceParameter.

- :mod:`.group`: process-group set-up (launcher environment or loopback),
  timeouts and check-ins; :class:`CollectiveGroup`.
- :mod:`.schedule`: the ring schedule, pure.
- :mod:`.ring`: :func:`reduce_scatter` and :func:`all_gather` (gloo ring or NCCL).
- :mod:`.allreduce_parameter`: :class:`AllReduceParameter` (BigDL's).
- :mod:`.sharded_optimizer`: :class:`ShardedOptimizer` (ZeRO-1).
"""

from gradhub.collective.allreduce_parameter import AllReduceParameter
from gradhub.collective.group import (
    DEFAULT_TIMEOUT,
    CollectiveFuture,
    CollectiveGroup,
    destroy_process_group,
    free_loopback_port,
    init_process_group_from_env,
    local_group,
)
from gradhub.collective.ring import all_gather, reduce_scatter
from gradhub.collective.sharded_optimizer import ShardedOptimizer

__all__ = [
    "DEFAULT_TIMEOUT",
    "AllReduceParameter",
    "CollectiveFuture",
    "CollectiveGroup",
    "ShardedOptimizer",
    "all_gather",
    "destroy_process_group",
    "free_loopback_port",
    "init_process_group_from_env",
    "local_group",
    "reduce_scatter",
]
