"""The job's runtime: environment, backend, process group, store, one timeout.

Every subsystem joins the job through this module:

- :func:`init` (``gradhub.init()``): a training script calls it once. It reads
  torchrun's standard environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``MASTER_ADDR``, ``MASTER_PORT``, and the elastic agent's
  ``TORCHELASTIC_RESTART_COUNT`` / ``TORCHELASTIC_MAX_RESTARTS``, which tell a
  restarted worker that it is one) and nothing else, sets up the default
  process group and returns a :class:`Runtime` that strategies and the
  trainer take their rank, device, store and
  :class:`~gradhub.transports.group.CollectiveGroup` from.
- :func:`init_process_group_from_env` does the same for code that only needs
  the group; :func:`local_group` sets one up on 127.0.0.1 with a given port,
  without touching the environment (tests, examples, benchmarks).

Decisions:

- **The backend** (:func:`pick_backend`): on a CUDA machine
  ``"cpu:gloo,cuda:nccl"``, the group ``init_process_group`` makes by default
  in recent torch: CUDA tensors go over NCCL, CPU tensors over gloo (and
  gradhub's shared memory or ring), so CPU collectives keep working beside a
  GPU job. Without CUDA, gloo. NCCL takes one GPU per rank ("Duplicate GPU
  detected"), so where this host runs more ranks than it has GPUs
  (``LOCAL_WORLD_SIZE``), the default is gloo: CUDA tensors then travel
  through host memory (:mod:`gradhub.collective.staging`). ``backend="gloo"``
  is gloo alone, ``backend="nccl"`` NCCL alone (CUDA tensors only).
- **The device** (:attr:`Runtime.device`): where batches go by default, the
  GPU ``LOCAL_RANK`` picks (modulo the GPUs) where the group carries CUDA
  tensors on NCCL, else the CPU. Models stay where the script put them
  (:func:`gradhub.prepare` moves nothing).
- **One default timeout**, :data:`DEFAULT_TIMEOUT` (300 s, torch's store
  default: collectives on big models after a slow first step need room). A
  process group the user created is adopted with its own timeout
  (``init_process_group(timeout=...)``) unless ``timeout=`` is given.
- Without ``RANK``/``WORLD_SIZE`` (a plain ``python script.py``) :func:`init`
  makes a one-process job: a world-size-1 group on an in-memory store, so
  every strategy runs the same code path with nothing to launch.
- A group that is already initialised (by the user or an earlier ``init``) is
  adopted, not re-created; closing the runtime then leaves it alone.
- Naming the rank that failed and translating c10d errors happen in one
  place, :meth:`CollectiveGroup.failure`, through the check-in store; the
  runtime's own waits (:meth:`Runtime.wait`) go through its group.
- The c10d store is exposed because it is how ranks find out about each other
  beyond collectives (check-ins, and the parameter-server addresses that
  ``gradhub run --servers`` publishes).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradhub.errors import ClosedError, LaunchEnvironmentError, RendezvousError
from gradhub.transports.choice import requested as requested_transport
from gradhub.transports.group import CollectiveGroup, default_store

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 300.0
"""Seconds set-up and any collective may take before it is an error, when
neither the caller nor the user's own process group says otherwise."""

_LAUNCH_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if "nccl" in backend and not torch.cuda.is_available():
        raise ValueError(f"backend {backend!r} needs CUDA, which is not available; use 'gloo'")
    return backend


def _check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")


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
    """c10d's error while joining the job, as ours (the one place set-up translates them)."""
    return RendezvousError(
        f"[rank {rank}] could not join the job through {where} within {timeout:g}s: "
        f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}\n"
        "- help: start every rank with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE; "
        "rank 0 hosts the store, and every rank must start within the timeout"
    )


def _tcp_store(host: str, port: int, world_size: int, rank: int, timeout: float) -> dist.Store:
    try:
        return dist.TCPStore(
            host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout)
        )
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
) -> CollectiveGroup:
    if "nccl" in backend:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    try:
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout),
        )
    except RuntimeError as exc:  # a peer that never connected (DistError)
        raise _joined(f"a {backend} process group of {world_size}", rank, timeout, exc) from exc
    pg = dist.group.WORLD
    assert pg is not None
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
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
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


@dataclass(kw_only=True)
class Runtime:
    """Where this process stands in the job.

    Use as a context manager or call :meth:`close` to tear the group down.
    """

    rank: int
    """This process's rank in ``[0, world_size)``."""
    world_size: int
    """Number of training processes in the job."""
    local_rank: int
    """Rank on this machine; picks the GPU."""
    device: torch.device
    """Where batches go by default: this rank's GPU where the group carries CUDA
    tensors on NCCL, else the CPU. A model stays where the script put it."""
    backend: str
    """c10d backend of the default group, as torch names it: ``"gloo"``,
    ``"nccl"`` or ``"cpu:gloo,cuda:nccl"`` (the default with CUDA); which device
    it serves how: ``group.backend_of(device)``."""
    timeout: float
    """Seconds any collective may take before it is an error."""
    store: dist.Store = field(repr=False)
    """The c10d key-value store shared by every rank of the job."""
    group: CollectiveGroup = field(repr=False)
    """The default process group with its check-ins; collectives of the job use it."""
    owns_group: bool = field(default=True, repr=False)
    """Whether :meth:`close` destroys the process group (this runtime created it)."""
    restart: int = 0
    """How many times torchrun's agent has restarted this job's workers
    (``TORCHELASTIC_RESTART_COUNT``; 0 on the first attempt)."""
    max_restarts: int = 0
    """How many restarts the agent allows (``TORCHELASTIC_MAX_RESTARTS``, set by
    ``gradhub run --max-restarts N``; 0: a failed worker ends the job)."""
    _closed: bool = field(default=False, repr=False)
    _waits: CollectiveGroup | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # The runtime's own waits run on the caller's thread while operations
        # of ``group`` run on its worker thread: separate counters keep each
        # one's numbering (and ring message tags) in step across ranks.
        self._waits = self.group.sibling()

    def local_device(self, kind: str) -> torch.device:
        """This rank's device of ``kind`` (a script's ``--device``): for ``"cuda"``
        the GPU ``LOCAL_RANK`` picks (modulo the GPUs), whatever the backend;
        for ``"cpu"`` the CPU."""
        if kind == "cpu":
            return torch.device("cpu")
        if kind != "cuda" or not torch.cuda.is_available():
            raise ValueError(f"device must be 'cpu' or 'cuda' (with CUDA available), got {kind!r}")
        return torch.device("cuda", self.local_rank % torch.cuda.device_count())

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that logs progress and writes shared files."""
        return self.rank == 0

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise ClosedError("this gradhub runtime was closed; call gradhub.init() again")

    def wait(self, work: Any, operation: str, *, where: str = "") -> None:
        """Wait for an asynchronous c10d work item, at most :attr:`timeout` seconds.

        A failure is a :class:`~gradhub.errors.WorkerFailedError` or
        :class:`~gradhub.errors.CollectiveTimeoutError` naming the rank(s)
        responsible; ``where`` (e.g. ``"step 12"``) makes the message specific.
        """
        assert self._waits is not None
        op = self._waits.begin(f"{operation} at {where}" if where else operation)
        self._waits.wait(op, work, None)

    def all_reduce_sum(self, tensor: torch.Tensor, *, where: str = "") -> torch.Tensor:
        """Sum ``tensor`` over every rank in place (bounded wait); returns it."""
        if self.world_size > 1:
            self.wait(dist.all_reduce(tensor, async_op=True), "all_reduce", where=where)
        return tensor

    def close(self) -> None:
        """Close the group; destroy the process group if this runtime created it.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._waits is not None:
            self._waits.close()
        self.group.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def init(
    *, backend: str | None = None, timeout: float | None = None, transport: str | None = None
) -> Runtime:
    """Join the job: read torchrun's environment and set up the process group.

    ``backend``: ``"gloo"``, ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``; by default
    the last where CUDA is available (see the module docstring), else gloo.
    ``timeout`` bounds every collective of the job (seconds; default
    :data:`DEFAULT_TIMEOUT`, or the timeout of a process group the user set
    up already); a rank that stops answering makes the others fail within it
    instead of hanging. ``transport`` picks how gradients travel between the
    ranks (``"shm"``, ``"hierarchical"``, ``"ring"``, ``"gloo"``; see
    :mod:`gradhub.transports.choice`); by default ``GRADHUB_TRANSPORT``,
    else shared memory on one host and the hierarchical path or the ring
    across hosts. Every strategy of the job uses it.
    """
    _check_timeout(timeout)
    if transport is not None:
        requested_transport(transport)  # a wrong name fails before anything is set up
    if backend is not None:
        pick_backend(backend)  # a wrong name fails before anything is set up
    launched = "RANK" in os.environ or "WORLD_SIZE" in os.environ
    if dist.is_initialized():
        group = CollectiveGroup.of(None, timeout=timeout, transport=transport)
        local_rank = _env_int(os.environ, "LOCAL_RANK", group.rank)
    elif launched:
        local_rank = _launch_env(os.environ)[2]
        group = init_process_group_from_env(backend=backend, timeout=timeout, transport=transport)
    else:
        local_rank = 0
        limit = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        group = _start(dist.HashStore(), 0, 1, pick_backend(backend), limit, 0, transport)
    if group.backend_of(torch.device("cuda")) == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    store = default_store()
    assert store is not None, "torch keeps the default group's store"
    runtime = Runtime(
        rank=group.rank,
        world_size=group.world_size,
        local_rank=local_rank,
        device=device,
        backend=group.backend,
        timeout=group.timeout,
        store=store,
        group=group,
        owns_group=group.owns_process_group,
        restart=_env_int(os.environ, "TORCHELASTIC_RESTART_COUNT", 0),
        max_restarts=_env_int(os.environ, "TORCHELASTIC_MAX_RESTARTS", 0),
    )
    log.debug("rank %d: joined %s", runtime.rank, runtime)
    return runtime
