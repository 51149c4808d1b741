"""How the bytes of a collective travel, and the group they travel in.

- :mod:`.group`: :class:`~.group.CollectiveGroup`, a process group with one
  timeout, check-ins and errors that name the rank; :mod:`.operation`: one
  operation in progress and its future.
- :mod:`.choice`: which transport a group takes (the one place that decides).
- :mod:`.p2p_ring`: the ring over point-to-point messages; :mod:`.schedule`:
  its schedule and summation order, pure.
- :mod:`.shm`: shared memory among the ranks of one host.
- :mod:`.hierarchical`: shared memory inside each host, the ring between hosts.

Below :mod:`gradhub.collective` (the public collectives, AllReduceParameter,
ShardedOptimizer) and the torch.distributed backend; above :mod:`gradhub._shm`.
"""
