"""How the bytes of a collective travel, and the group they travel in.

- :mod:`.base`: :class:`Transport`, the interface every transport implements
  (reduce-scatter, all-gather, all-reduce, broadcast, close), whose docstring
  is the contract: summation order, how a dead or late peer is named.
- :mod:`.choice`: which transport a group takes (the one place that decides:
  :func:`select`, :func:`chosen`, ``GRADHUB_TRANSPORT``).
- One module per transport: :mod:`.single` (one rank), :mod:`.native` (the
  backend's own collectives, ``"gloo"``), :mod:`.p2p_ring` (the ring over
  point-to-point messages, ``"ring"``), :mod:`.shm` (shared memory on one
  host, set up by :mod:`.shm_setup`), :mod:`.hierarchical` (shared memory
  inside each host, the ring between hosts).
- :mod:`.group`: :class:`CollectiveGroup`, a process group with one timeout,
  check-ins, a worker thread and errors that name the rank; :mod:`.operation`:
  one operation in progress and its future; :mod:`.stores`: what torch keeps
  about a group and its store, and the roll call; :mod:`.schedule`: the ring's
  schedule and summation order, pure.

A caller (:mod:`gradhub.collective.collectives`, the torch.distributed backend) runs
an operation on the group's worker thread as::

    op, transport = begin(group, "all_reduce", timeout)  # numbered, checked in, chosen
    transport.all_reduce(op, flat, codec, Chunking())

Layering: above :mod:`gradhub._shm` and the pure top-level modules, below
:mod:`gradhub.runtime` and every subsystem (``tests/core/test_import_graph.py``).
"""

from gradhub.transports.base import Chunking, Transport
from gradhub.transports.choice import CHOICES, begin, checks_in, chosen, requested, select
from gradhub.transports.group import CollectiveFuture, CollectiveGroup, Operation

__all__ = [
    "CHOICES",
    "Chunking",
    "CollectiveFuture",
    "CollectiveGroup",
    "Operation",
    "Transport",
    "begin",
    "checks_in",
    "chosen",
    "requested",
    "select",
]
