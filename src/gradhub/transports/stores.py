"""Facts torch keeps about a process group and its c10d store, read in one place."""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

_log = logging.getLogger("gradhub.collective")

ROLL_CALL_GRACE = 5.0
"""Seconds the survivors of a lost connection wait for each other to answer the
roll call (at most the operation's timeout); who has not answered by then is named."""


def process_group_timeout(pg: dist.ProcessGroup) -> float:
    """Seconds ``pg`` was created with (``init_process_group(timeout=...)``)."""
    for device in ("cpu", "cuda"):
        try:
            backend = pg._get_backend(torch.device(device))
            return float(backend.options._timeout.total_seconds())
        except (RuntimeError, AttributeError):
            continue
    return float(dist.distributed_c10d.default_pg_timeout.total_seconds())


def device_backends(backend: str) -> dict[str, str]:
    """Which backend carries the tensors of each device type in a process group
    of ``backend`` (torch's name for it): ``"cpu:gloo,cuda:nccl"`` (what
    ``init_process_group`` makes by default on a CUDA machine) gives
    ``{"cpu": "gloo", "cuda": "nccl"}``, ``"nccl"`` gives ``{"cuda": "nccl"}``,
    any other single name (``"gloo"``, ``"gradhub"``) ``{"cpu": name}``: gradhub's
    transports carry CPU memory, so CUDA tensors of such a group are staged
    through host memory (:mod:`gradhub.collective.staging`)."""
    name = backend.lower()
    if ":" in name:
        pairs = (part.split(":", 1) for part in name.split(",") if part)
        return {device.strip(): which.strip() for device, which in pairs}
    return {"cuda": name} if name == "nccl" else {"cpu": name}


def default_store() -> dist.Store | None:
    """The default process group's store, when torch exposes it."""
    # torch keeps the default group's store privately; use it when it is there.
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        store: dist.Store = getter()
    except (RuntimeError, ValueError):
        return None
    return store


def store_name(store: dist.Store | None) -> str:
    """``the c10d store at HOST:PORT`` (or its kind, when it has no address)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return f"the c10d store at {store.host}:{store.port}"
    return f"the c10d store ({type(store).__name__})"


def job_store(store: dist.Store) -> dist.Store:
    """The store beneath ``store``'s prefixes, under a ``gradhub/job/`` prefix.

    Under torchrun that is the store its agent hosts for the whole job and
    keeps across restarts, while each attempt's groups use prefixes of their own
    (:func:`gradhub.runtime.init_process_group_from_env`): what one attempt
    writes here, a restarted attempt reads.
    """
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return dist.PrefixStore("gradhub/job/", store)


def roll_call(
    store: dist.Store, rank: int, world_size: int, sequence: int, timeout: float
) -> tuple[list[int], list[int]]:
    """After a lost connection in operation ``sequence``: answer, and wait
    (blocking on the store, at most :data:`ROLL_CALL_GRACE` s) for the other
    ranks to answer too.

    Returns the ranks that did not answer and the ranks that gave up on the
    operation by their own timeout. With the store's host gone, it is named
    (rank 0 under ``env://``).
    """
    answer, gave_up = f"alive/{sequence}/", f"gave-up/{sequence}/"
    deadline = time.monotonic() + min(ROLL_CALL_GRACE, timeout)
    try:
        store.set(f"{answer}{rank}", "1")
        while True:
            quitters = [r for r in range(world_size) if store.check([f"{gave_up}{r}"])]
            silent = [r for r in range(world_size) if not store.check([f"{answer}{r}"])]
            left = deadline - time.monotonic()
            if quitters or not silent or left <= 0:
                return silent, quitters
            with contextlib.suppress(RuntimeError):  # not all answered yet
                store.wait([f"{answer}{r}" for r in silent], timedelta(seconds=min(left, 0.2)))
    except RuntimeError as exc:  # the store's host is gone
        _log.debug("[rank %d] store unreachable during the roll call: %s", rank, exc)
        return ([0] if rank != 0 else []), []


def gave_up(store: dist.Store | None, sequence: int, rank: int) -> bool:
    """Whether ``rank`` noted (``gave-up/<sequence>/<rank>``) that it ran out of
    time in operation ``sequence`` and left."""
    if store is None:
        return False
    try:
        return bool(store.check([f"gave-up/{sequence}/{rank}"]))
    except RuntimeError:  # the store's host is gone
        return False
