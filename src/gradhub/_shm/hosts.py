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

import logging
import os
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

_log = logging.getLogger(__name__)

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

    Returns ``(values by rank, [])``, or ``([], ranks that did not write theirs)``:
    within ``timeout`` seconds, or before the store's host left.
    """
    store.set(f"{key}/{rank}", value)
    keys = [f"{key}/{r}" for r in range(world_size)]
    unseen = dict(enumerate(keys))
    deadline = time.monotonic() + max(timeout, 0.0)
    pause = 0.001
    try:
        # Polled like wait_for_keys, remembering who has written: when the
        # store's host gives up on the same absent ranks first and takes the
        # store with it, those ranks are still the ones to name.
        while unseen and not store.check(list(unseen.values())):
            for r in [r for r, k in unseen.items() if store.check([k])]:
                del unseen[r]
            left = deadline - time.monotonic()
            if left <= 0:
                return [], sorted(unseen)
            time.sleep(min(pause, left))
            pause = min(2 * pause, 0.02)
        unseen.clear()
        return [store.get(k).decode() for k in keys], []
    except RuntimeError as exc:  # the store's host is gone
        if not unseen:
            raise
        _log.warning(
            "rank %d: the store went away waiting for ranks %s: %s", rank, sorted(unseen), exc
        )
        return [], sorted(unseen)


def wait_for_keys(store: dist.Store, keys: list[str], timeout: float) -> bool:
    """Whether every key of ``keys`` is in ``store`` within ``timeout`` seconds.

    Asks with ``check`` (which returns at once) and sleeps between the asks,
    1 ms growing to 20 ms, instead of one blocking ``wait``: a store client
    holds its connection for the whole of a ``wait``, so two groups setting up
    at once on one client (a group and its sibling on the default store) would
    each block the ``set`` the other's peers wait for. Used only at set-up.
    """
    deadline = time.monotonic() + max(timeout, 0.0)
    pause = 0.001
    while not store.check(keys):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(2 * pause, 0.02)
    return True
