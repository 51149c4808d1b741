"""Which transport a group's reduce-scatter and all-gather take.

- ``"ring"``: the gloo ring of :mod:`.ring` (the backend's own collectives for
  small vectors). Works everywhere; the only choice across hosts.
- ``"gloo"``: the backend's own collectives at every size
  (``all_to_all_single`` + ``all_gather_single``; ``all_reduce`` for
  :func:`.ring.all_reduce`).
- ``"shm"``: shared memory (:mod:`.shm`), for ranks on one host.

Choice: the ``transport=`` of the group, else ``GRADHUB_TRANSPORT``, else
``"auto"``, which takes ``"shm"`` when every rank of a gloo group is on this
host (:mod:`.hosts`: hostname, boot id and network namespace) and
``"ring"`` otherwise. The choice is made once per group, at its first
reduce-scatter or all-gather, by all ranks together through the store: ranks
that asked for different transports all get a ``ValueError``. Asking for
``"shm"`` when the ranks span hosts is a ``ValueError`` too (nothing is
silently slower than asked). A group without a store (a sub-group torch made)
takes the ring. Every transport gives the same bits (see :mod:`.shm`).

Decision: a job that spans hosts takes the ring between all its ranks; the
hierarchical variant (shared memory inside each host, the ring between
hosts) is not built yet.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from gradhub.collective import shm
from gradhub.collective.group import CollectiveGroup, Operation
from gradhub.collective.hosts import HostLayout, exchange, host_identity
from gradhub.collective.shm_memory import supported as shm_supported

_log = logging.getLogger("gradhub.collective")

TRANSPORT_ENV = "GRADHUB_TRANSPORT"
CHOICES = ("auto", "shm", "ring", "gloo")


def requested(explicit: str | None) -> str:
    """The transport asked for: ``explicit``, else ``GRADHUB_TRANSPORT``, else ``"auto"``."""
    name = explicit if explicit is not None else os.environ.get(TRANSPORT_ENV) or "auto"
    name = name.lower()
    if name not in CHOICES:
        source = "transport=" if explicit is not None else TRANSPORT_ENV
        raise ValueError(f"{source} must be one of {', '.join(CHOICES)}, got {name!r}")
    return name


class _Choice:
    def __init__(self, name: str, shared: shm.ShmTransport | None = None):
        self.name = name
        self.shared = shared


def select(group: CollectiveGroup, op: Operation) -> tuple[str, shm.ShmTransport | None]:
    """The group's transport name and, for ``"shm"``, its shared-memory transport.

    Collective the first time it is called on a group (inside an operation
    that every rank runs); cached afterwards.
    """
    choice: _Choice | None = group.transport_choice
    if choice is None:
        choice = _decide(group, op)
        group.transport_choice = choice
        group.on_close(lambda: _release(group))
    return choice.name, choice.shared


def chosen(group: CollectiveGroup) -> str | None:
    """The group's transport name once it has been chosen, else ``None``."""
    choice: _Choice | None = group.transport_choice
    return None if choice is None else choice.name


def _release(group: CollectiveGroup) -> None:
    choice: _Choice | None = group.transport_choice
    group.transport_choice = None
    if choice is not None and choice.shared is not None:
        choice.shared.close()


def _decide(group: CollectiveGroup, op: Operation) -> _Choice:
    asked = requested(group.transport)
    store = group.store
    if store is None or group.backend != "gloo":
        if asked == "shm":
            raise ValueError(
                f"[rank {group.rank}] transport 'shm' needs a gloo group with a c10d store"
            )
        return _Choice("ring" if asked == "auto" else asked)
    key = f"transport/{_generation(store, group.world_size)}"
    values, missing = exchange(
        store, group.rank, group.world_size, f"{asked}|{host_identity()}", key, op.remaining()
    )
    if missing:  # named by their check-ins, like any operation's timeout
        raise group._timed_out(op, missing[0] if len(missing) == 1 else None)
    asks = [v.split("|", 1)[0] for v in values]
    if len(set(asks)) > 1:
        raise ValueError(
            f"[rank {group.rank}] ranks asked for different transports: "
            + ", ".join(f"rank {r}: {a}" for r, a in enumerate(asks))
            + f"; set the same transport= or {TRANSPORT_ENV} on every rank"
        )
    layout = HostLayout.of([v.split("|", 1)[1] for v in values], group.rank)
    name = asked
    if asked == "auto":
        name = "shm" if layout.single_host and shm_supported() else "ring"
    if name == "shm" and not layout.single_host:
        raise ValueError(
            f"[rank {group.rank}] transport 'shm' needs every rank on one host; "
            f"these ranks are on {len(layout.hosts)} hosts: {[list(h) for h in layout.hosts]}"
        )
    if name != "shm":
        _log.debug("[rank %d] transport %s", group.rank, name)
        return _Choice(name)
    _log.debug("[rank %d] transport shm (%d ranks)", group.rank, group.world_size)
    return _Choice("shm", shm.ShmTransport(group, layout.local_ranks, op, f"{key}/shm"))


def _generation(store: dist.Store, world_size: int) -> int:
    """A number no earlier group on this store used (a store can outlive a group):
    every rank counts itself in once per group, so the ranks of the n-th group
    read counts in ``(n * world_size, (n + 1) * world_size]``."""
    return (int(store.add("transport/arrivals", 1)) - 1) // world_size
