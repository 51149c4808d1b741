"""Which transport a group's collectives take: the one place that decides.

- ``"ring"``: the gloo ring of :mod:`.p2p_ring` (the backend's own collectives
  for small vectors). Works everywhere; the flat ring across hosts.
- ``"gloo"``: the backend's own collectives at every size (:mod:`.native`:
  ``all_to_all_single`` + ``all_gather_single``; ``all_reduce`` for an
  all-reduce).
- ``"shm"``: shared memory (:mod:`.shm`), for ranks on one host.
- ``"hierarchical"``: shared memory inside each host and one ring per column
  of ranks between hosts (:mod:`.hierarchical`), for ranks on several hosts
  that each hold the same number (at least 2) of them: each host sends its
  bytes over the network once.

Choice: the ``transport=`` of the group, else ``GRADHUB_TRANSPORT``, else
``"auto"``, which takes ``"shm"`` when every rank of a gloo group is on this
host (:mod:`.hosts`: hostname, boot id and network namespace),
``"hierarchical"`` when the ranks span hosts that each hold the same number
(>= 2) of ranks, and ``"ring"`` otherwise (one rank per host, or hosts of
different sizes). The choice is made once per group, at its first
reduce-scatter or all-gather, by all ranks together through the store: ranks
that asked for different transports all get a ``ValueError``. Asking for
``"shm"`` when the ranks span hosts, or for ``"hierarchical"`` when the
layout does not fit it, is a ``ValueError`` too (nothing is silently slower
than asked). A group without a store (a sub-group torch made) takes the ring.
A group of one rank takes :mod:`.single` (nothing travels), whatever was asked.

Devices: the choice above is the transport of the group's own device (CPU
wherever a backend of the group carries CPU tensors). A group whose process
group carries CUDA tensors on a backend of their own (``"cpu:gloo,cuda:nccl"``,
what :func:`gradhub.init` makes on a CUDA machine) gives CUDA tensors a second
transport, :attr:`CollectiveGroup.device_transport`: NCCL's own collectives
(:mod:`.p2p_ring`'s NCCL path; :mod:`.native` with ``"gloo"`` asked), made
without a store exchange, as for a group on NCCL alone. CPU tensors of that
group take shared memory or the ring as on gloo. CUDA tensors of a group that
carries CPU tensors only (gloo) never reach a transport: the collectives stage
them through host memory (:mod:`gradhub.collective.staging`).

A new transport: a :class:`~.base.Transport` subclass in a module of its own
here, its name in :data:`CHOICES`, and its construction in :func:`_decide`.

Bits: ``"shm"``, ``"ring"`` and (for ``"none"``) ``"gloo"``'s collective
path give the same bits (see :mod:`.shm`), so a job on one host and the same
ranks on several hosts over the ring agree bit for bit. ``"hierarchical"``
adds each host's values first, a different association of the same fp32 sum
(see :mod:`.hierarchical`): every rank still ends with the same bits, but not
those of the flat ring; ``GRADHUB_TRANSPORT=ring`` keeps them.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from gradhub._shm.hosts import HostLayout, exchange, host_identity
from gradhub._shm.memory import supported as shm_supported
from gradhub.errors import InvalidOptionError
from gradhub.transports.base import Transport
from gradhub.transports.group import CollectiveGroup, Operation
from gradhub.transports.hierarchical import HierarchicalTransport, fits
from gradhub.transports.native import NativeTransport
from gradhub.transports.p2p_ring import RingTransport
from gradhub.transports.shm import ShmTransport
from gradhub.transports.single import SingleRankTransport

_log = logging.getLogger("gradhub.collective")

TRANSPORT_ENV = "GRADHUB_TRANSPORT"
CHOICES = ("auto", "shm", "hierarchical", "ring", "gloo")


def requested(explicit: str | None) -> str:
    """The transport asked for: ``explicit``, else ``GRADHUB_TRANSPORT``, else ``"auto"``."""
    name = explicit if explicit is not None else os.environ.get(TRANSPORT_ENV) or "auto"
    name = name.lower()
    if name not in CHOICES:
        source = "transport=" if explicit is not None else TRANSPORT_ENV
        raise InvalidOptionError(f"{source} must be one of {', '.join(CHOICES)}, got {name!r}")
    return name


def select(group: CollectiveGroup, op: Operation, device: torch.device | None = None) -> Transport:
    """The group's transport for tensors on ``device`` (default: the group's device).

    Collective the first time it is called on a group (inside an operation
    that every rank runs); cached afterwards, and closed with the group.
    """
    if device is not None and apart(group, device):
        found = group.device_transport
        if found is None:
            native = requested(group.transport) == "gloo"
            found = NativeTransport(group) if native else RingTransport(group)
            group.device_transport = found
            group.on_close(lambda: _release(group, "device_transport"))
        return found
    transport = group.transport_choice
    if transport is None:
        transport = _decide(group, op)
        group.transport_choice = transport
        group.on_close(lambda: _release(group, "transport_choice"))
    return transport


def apart(group: CollectiveGroup, device: torch.device) -> bool:
    """Whether tensors on ``device`` take the group's second transport: another
    device type than the group's own, carried by another backend (NCCL beside
    gloo; ``"cpu:gloo,cuda:gloo"`` is gloo's, whose CUDA tensors are staged)."""
    carrier = group.backend_of(device)
    return (
        group.world_size > 1
        and device.type != group.device.type
        and carrier not in (None, group.backend_of(group.device))
    )


def chosen(group: CollectiveGroup) -> str | None:
    """The group's transport name once it has been chosen, else ``None``."""
    transport = group.transport_choice
    return None if transport is None else transport.name


def begin(
    group: CollectiveGroup,
    name: str,
    timeout: float | None = None,
    device: torch.device | None = None,
) -> tuple[Operation, Transport]:
    """Start operation ``name`` of ``group`` on tensors on ``device``: number it,
    check in where its transport does not tell by itself who entered, and
    choose that transport (the one call every collective body makes)."""
    op = group.begin(name, timeout, check_in=checks_in(group, device))
    return op, select(group, op, device)


def checks_in(group: CollectiveGroup, device: torch.device | None = None) -> bool:
    """Whether the group's next operation (on tensors on ``device``) checks in
    through the store: yes until a transport that tells by itself who entered
    is chosen."""
    apart_ = device is not None and apart(group, device)
    transport = group.device_transport if apart_ else group.transport_choice
    return transport is None or transport.checks_in


def _release(group: CollectiveGroup, slot: str) -> None:
    transport: Transport | None = getattr(group, slot)
    setattr(group, slot, None)
    if transport is not None:
        transport.close()


def _decide(group: CollectiveGroup, op: Operation) -> Transport:
    asked = requested(group.transport)
    if group.world_size == 1:
        return SingleRankTransport(group)
    store = group.store
    if store is None or group.backend_of(group.device) != "gloo":
        if asked == "shm":
            raise InvalidOptionError(
                f"[rank {group.rank}] transport 'shm' needs a gloo group with a c10d store"
            )
        return NativeTransport(group) if asked == "gloo" else RingTransport(group)
    key = f"transport/{_generation(store, group.world_size)}"
    values, missing = exchange(
        store, group.rank, group.world_size, f"{asked}|{host_identity()}", key, op.remaining()
    )
    if missing:  # they have not entered the operation: they wrote no transport key
        raise group.timed_out(op, missing[0] if len(missing) == 1 else None, absent=missing)
    asks = [v.split("|", 1)[0] for v in values]
    if len(set(asks)) > 1:
        raise InvalidOptionError(
            f"[rank {group.rank}] ranks asked for different transports: "
            + ", ".join(f"rank {r}: {a}" for r, a in enumerate(asks))
            + f"; set the same transport= or {TRANSPORT_ENV} on every rank"
        )
    layout = HostLayout.of([v.split("|", 1)[1] for v in values], group.rank)
    name = asked
    if asked == "auto":
        name = "ring"
        if shm_supported() and layout.single_host:
            name = "shm"
        elif shm_supported() and fits(layout):
            name = "hierarchical"
    hosts = [list(h) for h in layout.hosts]
    if name == "shm" and not layout.single_host:
        raise InvalidOptionError(
            f"[rank {group.rank}] transport 'shm' needs every rank on one host; "
            f"these ranks are on {len(layout.hosts)} hosts: {hosts}"
        )
    if name == "hierarchical" and not fits(layout):
        raise InvalidOptionError(
            f"[rank {group.rank}] transport 'hierarchical' needs several hosts with the same "
            f"number (>= 2) of ranks each; these ranks are on {len(hosts)} host(s): {hosts}"
        )
    _log.debug("[rank %d] transport %s (hosts %s)", group.rank, name, hosts)
    if name == "hierarchical":
        return HierarchicalTransport(group, layout, op, f"{key}/hierarchical")
    if name == "shm":
        return ShmTransport(group, layout.local_ranks, op, f"{key}/shm")
    return NativeTransport(group) if name == "gloo" else RingTransport(group)


def _generation(store: dist.Store, world_size: int) -> int:
    """A number no earlier group on this store used (a store can outlive a group):
    every rank counts itself in once per group, so the ranks of the n-th group
    read counts in ``(n * world_size, (n + 1) * world_size]``."""
    return (int(store.add("transport/arrivals", 1)) - 1) // world_size
