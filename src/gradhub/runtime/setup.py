"""Setting up the default process group: backend, store, timeout (see :mod:`gradhub.runtime`)."""

from __future__ import annotations

import logging
import os
import random
import socket
from collections.abc import Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before any group exists: this module binds the default group as its
# functions' default argument on first import (torch imports it lazily, e.g. with
# its compiler), which would keep a destroyed gloo group alive until interpreter
# exit, where gloo's threads freeing their last tensors abort the process.
import torch.distributed.nn.functional

from gradhub.errors import InvalidOptionError, LaunchEnvironmentError, RendezvousError
from gradhub.transports.c10d_errors import rendezvous_error
from gradhub.transports.choice import requested as requested_transport
from gradhub.transports.group import CollectiveGroup

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 300.0
"""Seconds set-up and any collective may take before it is an error, when
neither the caller nor the user's own process group says otherwise."""

_LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's
    range of ephemeral ports where it can be: a port from that range may become
    another process's end of a connection (a store or gloo client) between this
    pick and its bind (EADDRINUSE); one below it, only another pick's."""
    low, pick = _ephemeral_low(), random.SystemRandom()
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", pick.randrange(10_000, low) if low > 10_000 else 0))
            except OSError:  # taken (or lingering): another
                continue
            return int(s.getsockname()[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out on its own (Linux; else 32768)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


BOTH = "cpu:gloo,cuda:nccl"
"""The default backend on a CUDA machine: CPU tensors on gloo, CUDA tensors on NCCL."""

BACKENDS = ("gloo", "nccl", BOTH)


def pick_backend(backend: str | None, local_ranks: int = 1) -> str:
    """``backend`` checked, or the default (see the module docstring):
    :data:`BOTH` where CUDA is available and this host's ``local_ranks`` ranks
    each have a GPU of their own, else gloo."""
    if backend is None:
        if not torch.cuda.is_available():
            return "gloo"
        gpus = torch.cuda.device_count()
        if local_ranks > gpus:
            log.info(
                "%d ranks on this host and %d GPU(s): NCCL takes one GPU per rank, so the "
                "group is gloo (CUDA tensors travel through host memory)",
                local_ranks,
                gpus,
            )
            return "gloo"
        return BOTH
    if backend not in BACKENDS:
        raise InvalidOptionError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if "nccl" in backend and not torch.cuda.is_available():
        raise InvalidOptionError(
            f"backend {backend!r} needs CUDA, which is not available; use 'gloo'"
        )
    return backend


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise InvalidOptionError(f"timeout must be > 0 seconds, got {timeout!r}")


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvironmentError(
            f"environment variable {name}={raw!r} is not an integer"
        ) from None


def _launch_env(environ: Mapping[str, str]) -> tuple[int, int, int]:
    """``(rank, world_size, local_rank)`` from a launcher's complete environment."""
    missing = [k for k in _LAUNCH_KEYS if k not in environ]
    if missing:
        raise LaunchEnvironmentError(
            f"launcher environment incomplete: {', '.join(missing)} not set\n"
            "- help: start the script with `gradhub run -n N script.py` or torchrun, "
            "or use gradhub.collective.local_group(rank, world_size, port)"
        )
    rank, world_size = _env_int(environ, "RANK", 0), _env_int(environ, "WORLD_SIZE", 1)
    if not 0 <= rank < world_size:
        raise LaunchEnvironmentError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")
    return rank, world_size, _env_int(environ, "LOCAL_RANK", rank)


def _joined(where: str, rank: int, timeout: float, exc: RuntimeError) -> RendezvousError:
    """c10d's error while joining the job through ``where``, as ours
    (:func:`~gradhub.transports.c10d_errors.rendezvous_error`)."""
    return rendezvous_error(
        exc,
        what=f"[rank {rank}] could not join the job through {where}",
        timeout=timeout,
        help="start every rank with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE; "
        "rank 0 hosts the store, and every rank must start within the timeout",
    )


def _tcp_store(host: str, port: int, world_size: int, rank: int, timeout: float) -> dist.Store:
    try:
        return dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout)
        )
    except RuntimeError as exc:  # DistNetworkError, DistStoreError
        raise _joined(f"the store at {host}:{port}", rank, timeout, exc) from exc


def _tcp_client(host: str, port: int, rank: int, timeout: float) -> dist.Store:
    """A client of a store another process hosts (a surviving job's launcher)."""
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
    except RuntimeError as exc:  # DistNetworkError, DistStoreError
        raise _joined(f"the store at {host}:{port}", rank, timeout, exc) from exc


def _start(
    store: dist.Store,
    rank: int,
    world_size: int,
    backend: str,
    timeout: float,
    local_rank: int,
    transport: str | None = None,
    rendezvous: float | None = None,
) -> CollectiveGroup:
    """The default process group; ``rendezvous``: seconds its set-up may take
    (default: ``timeout``, which then bounds each of its operations)."""
    if "nccl" in backend:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    limit = timeout if rendezvous is None else rendezvous
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=limit),
        )
    except RuntimeError as exc:  # a peer that never connected (DistError)
        raise _joined(f"a {backend} process group of {world_size}", rank, limit, exc) from exc
    pg = dist.group.WORLD
    assert pg is not None
    if limit != timeout:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout), pg)
    group = CollectiveGroup(
        pg, store=store, timeout=timeout, owns_process_group=True, transport=transport
    )
    log.info("[rank %d] %s process group of %d ready", rank, backend, world_size)
    return group


def init_process_group_from_env(
    *,
    backend: str | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    transport: str | None = None,
) -> CollectiveGroup:
    """Set up the default process group from the launcher's environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and
    ``LOCAL_RANK`` to pick the GPU, ``LOCAL_WORLD_SIZE`` to count this host's
    ranks) from ``env`` (default ``os.environ``). ``backend``: see
    :func:`pick_backend` (default ``"cpu:gloo,cuda:nccl"`` with CUDA, else gloo).
    ``timeout`` (seconds, default :data:`DEFAULT_TIMEOUT`) bounds set-up and
    every operation. If the default group already exists it is wrapped (with
    its own timeout unless ``timeout`` is given), so calling this twice is
    harmless. ``transport``: how the group's reduce-scatter and all-gather
    travel (see :mod:`gradhub.transports.choice`; default:
    ``GRADHUB_TRANSPORT``, else chosen from where the ranks are). The caller
    owns the returned group: close it (or ``with``).
    """
    _check_timeout(timeout)
    if transport is not None:
        requested_transport(transport)  # a wrong name fails before anything is set up
    if dist.is_initialized():
        return CollectiveGroup.of(None, timeout=timeout, transport=transport)
    environ = os.environ if env is None else env
    rank, world_size, local_rank = _launch_env(environ)
    backend = pick_backend(backend, _env_int(environ, "LOCAL_WORLD_SIZE", 1))
    limit = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    td = timedelta(seconds=limit)
    if env is None:
        # The env:// rendezvous also handles torchrun's agent-hosted store.
        try:
            store, rank, world_size = next(dist.rendezvous("env://", timeout=td))
        except RuntimeError as exc:
            where = f"env:// at {environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
            raise _joined(where, rank, limit, exc) from exc
        attempt = _env_int(environ, "TORCHELASTIC_RESTART_COUNT", 0)
        if attempt:
            # torchrun's agent keeps its store across restarts: this attempt must
            # not read the last one's keys (gloo's addresses, check-ins).
            store = dist.PrefixStore(f"gradhub/attempt-{attempt}", store)
    else:
        host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
        store = _tcp_store(host, port, world_size, rank, limit)
    return _start(store, rank, world_size, backend, limit, local_rank, transport)


def local_group(
    rank: int,
    world_size: int,
    port: int,
    *,
    backend: str | None = None,
    timeout: float | None = None,
    transport: str | None = None,
) -> CollectiveGroup:
    """Set up the default process group on 127.0.0.1:``port`` (rank 0 hosts the store).

    For tests, examples and benchmarks: every rank calls it with the same
    ``world_size`` and ``port`` (see :func:`free_loopback_port`). Use it as a
    context manager to tear the group down. ``timeout`` defaults to
    :data:`DEFAULT_TIMEOUT`. ``transport``: see :mod:`gradhub.transports.choice`
    (default: ``GRADHUB_TRANSPORT``, else shared memory on one host, the ring across hosts).
    """
    if not 0 <= rank < world_size:
        raise InvalidOptionError(f"rank must be in [0, {world_size}), got {rank}")
    _check_timeout(timeout)
    backend = pick_backend(backend, world_size)  # every rank on this host
    limit = DEFAULT_TIMEOUT if timeout is None else float(timeout)
    store = _tcp_store("127.0.0.1", port, world_size, rank, limit)
    return _start(store, rank, world_size, backend, limit, rank, transport)


def destroy_process_group() -> None:
    """Destroy the default process group, if there is one.

    Groups from :func:`local_group` or :func:`init_process_group_from_env`
    do this when closed; this is for a group whose wrapper was dropped.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
