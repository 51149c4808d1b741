"""Collectives: process groups, ring reduce-scatter/all-gather, AllReduceParameter.

- :mod:`.group`: :class:`CollectiveGroup`, a process group with one timeout,
  check-ins and errors that name the rank (set-up: :mod:`gradhub.runtime`,
  re-exported here).
- :mod:`.schedule`: the ring schedule, pure.
- :mod:`.ring`: :func:`reduce_scatter`, :func:`all_gather`, :func:`all_reduce`
  (gloo ring or NCCL), dispatching to the group's transport.
- :mod:`.transport`: which transport a group takes (``shm``, ``hierarchical``,
  ``ring``, ``gloo``); :mod:`.hosts`: which ranks share a host; :mod:`.shm`:
  shared memory; :mod:`.hierarchical`: shared memory inside each host and the
  ring between hosts.
- :mod:`.allreduce_parameter`: :class:`AllReduceParameter` (BigDL's).
- :mod:`.sharded_optimizer`: :class:`ShardedOptimizer` (ZeRO-1).
"""

from gradhub.collective.allreduce_parameter import AllReduceParameter
from gradhub.collective.group import CollectiveFuture, CollectiveGroup
from gradhub.collective.ring import all_gather, all_reduce, reduce_scatter
from gradhub.collective.sharded_optimizer import ShardedOptimizer

# Set-up lives in gradhub.runtime (which imports .group, so it comes last here).
from gradhub.runtime import (
    DEFAULT_TIMEOUT,
    destroy_process_group,
    free_loopback_port,
    init_process_group_from_env,
    local_group,
)

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
