"""Registering the backend and building a group when torch asks for one.

:func:`register` records ``"gradhub"`` with
``torch.distributed.Backend.register_backend(..., devices=["cpu"])`` at
``import gradhub``; torch then calls :func:`create` inside
``init_process_group("gradhub")`` and ``new_group(backend="gradhub")``. In a
process that never imports gradhub, the ``torch.backends`` entry point
(:mod:`gradhub_autoload`) registers the same name with a creator that imports
this module when torch first calls it; whichever registers first stays (both
end in :func:`create`). This module does not import :mod:`gradhub_autoload`.

Decisions:

- **Two inner gloo groups per gradhub group**, over the group's own store
  (under its prefix): one carries gradhub's transports (the ring between hosts,
  small vectors) and every operation the transports do not cover, in the order
  of the group's worker thread; the other carries point-to-point messages only,
  so user tags can never meet the ring's tags. Both are registered with torch
  (as ``<group>/gradhub-collectives`` and ``<group>/gradhub-p2p``) because
  gradhub's collective layer addresses its group through ``torch.distributed``'s
  functions; destroying the gradhub group destroys them.
- torch's creator API gives no group name to a plain creator, so the creator
  uses the extended API (``DistributedBackendOptions``: store, rank, size,
  timeout, group id, global ranks).
- Every failure while building is a :class:`~gradhub.errors.RendezvousError`
  naming the group, raised from ``init_process_group`` itself.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from gradhub.backend.process_group import GradhubProcessGroup
from gradhub.transports.c10d_errors import rendezvous_error

NAME = "gradhub"
"""The backend's name: ``dist.init_process_group("gradhub")``."""


def register() -> bool:
    """Register ``"gradhub"`` for CPU tensors; ``True`` when it is registered.

    Idempotent; never raises (a torch without the API leaves it unregistered).
    """
    try:
        if not dist.is_available():
            return False
        backend = dist.Backend
        if NAME.upper() in getattr(backend, "_plugins", {}):
            return True
        backend.register_backend(NAME, create, extended_api=True, devices=["cpu"])
        return True
    except Exception:  # never break `import gradhub`
        return False


def create(options: Any, backend_options: Any = None) -> GradhubProcessGroup:
    """Build the gradhub process group torch asked for (torch's creator callback)."""
    store: dist.Store = options.store
    rank, size = int(options.group_rank), int(options.group_size)
    timeout: timedelta = options.timeout
    name = str(options.group_id)
    global_ranks = [int(r) for r in options.global_ranks_in_group]
    try:
        collectives = _inner_group(
            f"{name}/gradhub-collectives", store, rank, size, timeout, global_ranks
        )
        p2p = _inner_group(f"{name}/gradhub-p2p", store, rank, size, timeout, global_ranks)
    except RuntimeError as exc:  # a peer that never came (DistError)
        raise rendezvous_error(
            exc,
            what=f"[rank {rank}] the gradhub process group {name!r} of {size} could not "
            "connect its gloo groups",
            timeout=timeout.total_seconds(),
            help="every rank of the group must create it within the timeout",
        ) from exc
    return GradhubProcessGroup(store, rank, size, timeout=timeout, collectives=collectives, p2p=p2p)


def _inner_group(
    name: str,
    store: dist.Store,
    rank: int,
    size: int,
    timeout: timedelta,
    global_ranks: list[int],
) -> dist.ProcessGroup:
    """A gloo group of the same ranks, registered with torch under ``name``."""
    pg, _ = c10d._new_process_group_helper(
        size, rank, global_ranks, "gloo", store, group_name=c10d.GroupName(name), timeout=timeout
    )
    ranks = global_ranks if global_ranks else list(range(size))
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    return pg  # type: ignore[no-any-return]
