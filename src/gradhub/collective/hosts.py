"""Which ranks of a group share a host.

Two processes "share a host" when they can map the same memory and reach the
same abstract Unix sockets: same kernel boot (hostname plus
``/proc/sys/kernel/random/boot_id``) and same network namespace (abstract
socket names are per network namespace, so ranks in emulated hosts built
from namespaces count as different hosts, as they should).

``GRADHUB_HOST_ID`` replaces the identity (tests use it to fake several hosts
on one machine; a user can use it to keep shared memory out of a job).
The identities are exchanged through the group's c10d store once per group.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

HOST_ID_ENV = "GRADHUB_HOST_ID"


def host_identity() -> str:
    """This process's host identity: hostname, boot id and network namespace."""
    override = os.environ.get(HOST_ID_ENV)
    if override:
        return override
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append("?")
    try:
        parts.append(os.readlink("/proc/self/ns/net"))
    except OSError:
        parts.append("?")
    return "/".join(parts)


@dataclass(frozen=True)
class HostLayout:
    """The ranks of a group by host; hosts ordered by their lowest rank."""

    hosts: tuple[tuple[int, ...], ...]
    rank: int

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The ranks on this rank's host, ascending (this rank included)."""
        return next(h for h in self.hosts if self.rank in h)

    @property
    def single_host(self) -> bool:
        return len(self.hosts) == 1

    @classmethod
    def of(cls, identities: list[str], rank: int) -> HostLayout:
        by_host: dict[str, list[int]] = {}
        for r, ident in enumerate(identities):
            by_host.setdefault(ident, []).append(r)
        return cls(tuple(tuple(ranks) for ranks in by_host.values()), rank)


def exchange(
    store: dist.Store, rank: int, world_size: int, value: str, key: str, timeout: float
) -> tuple[list[str], list[int]]:
    """Every rank's ``value`` under ``key`` (set here, read from all ranks).

    Returns ``(values by rank, [])``, or ``([], ranks that did not write theirs
    within timeout seconds)``.
    """
    store.set(f"{key}/{rank}", value)
    keys = [f"{key}/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=max(timeout, 0.001)))
    except RuntimeError:  # c10d's timeout (DistStoreError is a RuntimeError)
        return [], [r for r, k in enumerate(keys) if not store.check([k])]
    return [store.get(k).decode() for k in keys], []
