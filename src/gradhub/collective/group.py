"""Process groups: set-up from the launcher's environment, timeouts, check-in.

:class:`CollectiveGroup` wraps one ``torch.distributed`` process group with
what gradhub's collectives need around it: the backend and device, one
timeout, a c10d store for check-ins, an operation counter and one worker
thread on which operations run in order.

Set-up:

- :func:`init_process_group_from_env` reads ``RANK``, ``WORLD_SIZE``,
  ``MASTER_ADDR`` and ``MASTER_PORT`` (what ``torchrun`` and ``gradhub run``
  set), picks NCCL when CUDA is available and gloo otherwise, and initialises
  the default process group with an explicit timeout. It is what
  ``gradhub.init()`` calls.
- :func:`local_group` does the same on 127.0.0.1 with a given port, without
  touching the environment (tests, examples, benchmarks).
- :func:`destroy_process_group` (or ``with group:``) tears it down.

Decisions:

- **Check-in.** At the start of every operation each rank writes the
  operation's sequence number under its own key in the store (one key per
  rank, overwritten, so the store does not grow). When a wait times out, the
  ranks whose number is behind are the ones that did not enter the
  operation; those are named in :class:`~gradhub.errors.CollectiveTimeoutError`.
  If every rank entered it, the peer that was being waited on is named. A
  group that wraps a process group gradhub did not create uses the default
  store when torch exposes it, else it names the peer only.
- **A timeout breaks the group.** Messages of the failed operation may still
  be in flight, so later operations on the group raise
  :class:`~gradhub.errors.StateError`; destroy and re-create it.
- **A lost connection** (the peer process died) is a
  :class:`~gradhub.errors.WorkerFailedError` naming the peer, not a timeout.
- Ranks in errors are ranks within the group (the same as global ranks for
  the default group).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch
import torch.distributed as dist

from gradhub.errors import (
    ClosedError,
    CollectiveTimeoutError,
    StateError,
    WorkerFailedError,
)

_log = logging.getLogger("gradhub.collective")

DEFAULT_TIMEOUT = 300.0
"""Seconds an operation may take before :class:`CollectiveTimeoutError` (torch's
store default; collectives on big models after a slow first step need room)."""

_FUTURE_GRACE = 10.0
"""Seconds a future waits beyond its operation's own deadline before it gives up
on the worker thread."""

T = TypeVar("T")


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Operation:
    """One collective in progress: its name, sequence number and deadline."""

    name: str
    sequence: int
    timeout: float
    deadline: float

    def remaining(self) -> float:
        return self.deadline - time.monotonic()


class CollectiveFuture(Generic[T]):
    """The result of an operation running on a group's worker thread.

    ``wait()`` returns the result or raises the operation's error. It never
    waits forever: an operation is bounded by its own timeout once it starts,
    and operations queued before it are bounded by theirs.
    """

    def __init__(self, operation: str, timeout: float):
        self._future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._operation = operation
        self._timeout = timeout
        self._started: float | None = None

    def _mark_started(self) -> None:
        self._started = time.monotonic()

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> T:
        """The operation's result. ``timeout`` bounds this call in seconds; by
        default it waits as long as the operation (and those before it) may take."""
        begin = time.monotonic()
        while True:
            # Poll with concurrent.futures.wait: result(timeout=) raises TimeoutError
            # on expiry, which CollectiveTimeoutError (the operation's own error)
            # also is, and the two must not be confused.
            done, _ = concurrent.futures.wait([self._future], timeout=0.5)
            if done:
                return self._future.result()
            now = time.monotonic()
            if timeout is not None and now - begin >= timeout:
                raise CollectiveTimeoutError(
                    self._operation, [], timeout, "the caller's wait ran out first"
                )
            started = self._started
            if started is not None and now - started > self._timeout + _FUTURE_GRACE:
                raise CollectiveTimeoutError(
                    self._operation,
                    [],
                    self._timeout,
                    "the operation did not return past its own deadline",
                )


class CollectiveGroup:
    """A process group plus what gradhub's collectives need around it.

    Build one with :func:`init_process_group_from_env`, :func:`local_group` or
    :meth:`of` (which wraps an existing torch process group, or the default
    one). One object exists per process group in a process; its operation
    counter must advance in step on every rank, so every rank must run the
    same operations on it in the same order.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        *,
        store: dist.Store | None,
        timeout: float,
        owns_process_group: bool = False,
    ):
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.backend = str(dist.get_backend(process_group))
        self.device = (
            torch.device("cuda", torch.cuda.current_device())
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self.timeout = float(timeout)
        name = getattr(process_group, "group_name", "default")
        self._store = (
            dist.PrefixStore(f"gradhub/collective/{name}/", store) if store is not None else None
        )
        self._owns = owns_process_group
        self._sequence = 0
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._broken: str | None = None
        self._closed = False
        self._scratch: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._check_in(0)

    # ----------------------------------------------------------------- set-up
    @classmethod
    def of(
        cls,
        group: CollectiveGroup | dist.ProcessGroup | None = None,
        *,
        timeout: float | None = None,
    ) -> CollectiveGroup:
        """The :class:`CollectiveGroup` of ``group`` (default: the default process group).

        ``timeout`` only applies when the wrapper is created here; a group set up
        by :func:`init_process_group_from_env` keeps its own.
        """
        if isinstance(group, CollectiveGroup):
            return group
        if not dist.is_available() or not dist.is_initialized():
            raise StateError(
                "no process group is set up; call gradhub.init() (or "
                "gradhub.collective.init_process_group_from_env()) first, or pass group="
            )
        pg = group if group is not None else dist.group.WORLD
        assert pg is not None
        key = getattr(pg, "group_name", str(id(pg)))
        existing = _GROUPS.get(key)
        if existing is not None and existing.process_group is pg and not existing._closed:
            return existing
        store = _default_store() if group is None or pg is dist.group.WORLD else None
        wrapped = cls(pg, store=store, timeout=DEFAULT_TIMEOUT if timeout is None else timeout)
        _GROUPS[key] = wrapped
        return wrapped

    # ------------------------------------------------------------- operations
    def begin(self, name: str, timeout: float | None = None) -> Operation:
        """Start operation ``name``: check it is allowed, number it, check in."""
        if self._closed:
            raise ClosedError(f"[rank {self.rank}] {name}: the collective group is closed")
        if self._broken is not None:
            raise StateError(
                f"[rank {self.rank}] {name}: the group is broken by an earlier failure "
                f"({self._broken}); destroy the process group and set it up again"
            )
        with self._lock:
            self._sequence += 1
            sequence = self._sequence
        self._check_in(sequence)
        limit = self.timeout if timeout is None else float(timeout)
        return Operation(name, sequence, limit, time.monotonic() + limit)

    def wait(self, op: Operation, work: Any, peer: int | None) -> None:
        """Wait for ``work`` within ``op``'s deadline; ``peer`` is the rank it depends on.

        Raises :class:`CollectiveTimeoutError` naming the missing ranks, or
        :class:`WorkerFailedError` when the connection to ``peer`` was lost.
        """
        remaining = op.remaining()
        try:
            finished = work.wait(timedelta(seconds=max(remaining, 0.001)))
        except RuntimeError as exc:
            text = str(exc)
            if "timed out" in text.lower() or "timeout" in text.lower() or op.remaining() <= 0:
                raise self._timeout_error(op, peer) from exc
            self._broken = f"{op.name} failed"
            who = f"rank {peer}" if peer is not None else "a peer"
            raise WorkerFailedError(
                f"[rank {self.rank}] {op.name}: communication with {who} failed ({text.strip()}); "
                "that process probably died. The group is unusable: stop this process and "
                "restart the job"
            ) from exc
        if finished is False:
            raise self._timeout_error(op, peer)

    def _timeout_error(self, op: Operation, peer: int | None) -> CollectiveTimeoutError:
        self._broken = f"{op.name} timed out"
        absent = self.missing_ranks(op.sequence)
        if absent:
            missing = absent
            detail = "not entered the operation"
            if peer is not None:
                detail += f"; rank {self.rank} was waiting on rank {peer}"
        elif peer is not None:
            missing = [peer]
            detail = f"rank {self.rank} was waiting on rank {peer}" + (
                "; every rank entered the operation" if absent is not None else ""
            )
        else:
            missing, detail = [], ""
        err = CollectiveTimeoutError(op.name, missing, op.timeout, detail)
        _log.error("[rank %d] %s", self.rank, err)
        return err

    def missing_ranks(self, sequence: int) -> list[int] | None:
        """Ranks whose last check-in is before operation ``sequence``; ``None`` when
        the store cannot be read (no store, or its host is gone)."""
        if self._store is None:
            return None
        missing = []
        try:
            for r in range(self.world_size):
                key = f"checkin/{r}"
                if not self._store.check([key]) or int(self._store.get(key)) < sequence:
                    missing.append(r)
        except (RuntimeError, ValueError) as exc:  # store host gone, or garbage
            _log.warning("[rank %d] cannot read check-ins: %s", self.rank, exc)
            return None
        return missing

    def _check_in(self, sequence: int) -> None:
        if self._store is not None:
            self._store.set(f"checkin/{self.rank}", str(sequence))

    def submit(self, name: str, fn: Callable[[], T]) -> CollectiveFuture[T]:
        """Run ``fn`` on the group's worker thread, after every operation submitted
        before it; the same order on every rank keeps the ranks in step."""
        if self._closed:
            raise ClosedError(f"[rank {self.rank}] {name}: the collective group is closed")
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"gradhub-collective-r{self.rank}"
            )
        future: CollectiveFuture[T] = CollectiveFuture(name, self.timeout)

        def run() -> T:
            future._mark_started()
            return fn()

        future._future = self._executor.submit(run)
        return future

    def scratch(self, slot: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reusable buffer of ``numel`` elements for ``slot`` (grown, never shrunk).

        For the bodies of operations, which run one at a time on the worker
        thread: fresh large buffers every call would cost a page fault per 4 KiB,
        as much as the transfer itself on a CPU. Never hand one to a caller.
        """
        buf = self._scratch.get((slot, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self.device)
            self._scratch[(slot, dtype)] = buf
        return buf[:numel]

    def all_gather_ints(self, values: list[int], name: str) -> list[list[int]]:
        """Every rank's ``values`` (same length on every rank), by rank."""
        op = self.begin(name)
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world_size)]
        work = dist.all_gather(out, mine, group=self.process_group, async_op=True)
        self.wait(op, work, None)
        return [t.tolist() for t in out]

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Stop the worker thread; destroy the process group if this group set it up.

        Idempotent. Operations still queued finish (each is bounded by its timeout).
        """
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._scratch.clear()
        for key, g in list(_GROUPS.items()):
            if g is self:
                del _GROUPS[key]
        if self._owns and dist.is_initialized():
            dist.destroy_process_group(self.process_group)
            _log.debug("[rank %d] process group destroyed", self.rank)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> CollectiveGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CollectiveGroup(rank={self.rank}, world_size={self.world_size}, "
            f"backend={self.backend!r}, timeout={self.timeout:g})"
        )


_GROUPS: dict[str, CollectiveGroup] = {}
"""One wrapper per live process group in this process (see :meth:`CollectiveGroup.of`)."""


def _default_store() -> dist.Store | None:
    # torch keeps the default group's store privately; use it when it is there.
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        store: dist.Store = getter()
    except (RuntimeError, ValueError):
        return None
    return store


def _pick_backend(backend: str | None) -> str:
    if backend is None:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, which is not available; use 'gloo'")
    return backend


def _start(
    store: dist.Store, rank: int, world_size: int, backend: str, timeout: float, local_rank: int
) -> CollectiveGroup:
    if backend == "nccl":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
    )
    pg = dist.group.WORLD
    assert pg is not None
    group = CollectiveGroup(pg, store=store, timeout=timeout, owns_process_group=True)
    _GROUPS[getattr(pg, "group_name", str(id(pg)))] = group
    _log.info("[rank %d] %s process group of %d ready", rank, backend, world_size)
    return group


def init_process_group_from_env(
    *,
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    env: Mapping[str, str] | None = None,
) -> CollectiveGroup:
    """Set up the default process group from the launcher's environment.

    Reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (and
    ``LOCAL_RANK`` to pick the GPU) from ``env`` (default ``os.environ``).
    ``backend`` defaults to NCCL when CUDA is available, else gloo. If the
    default group already exists it is wrapped and returned, so calling this
    twice is harmless. ``timeout`` (seconds) bounds set-up and every operation.
    """
    environ = os.environ if env is None else env
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in environ]
    if dist.is_initialized():
        return CollectiveGroup.of(None, timeout=timeout)
    if missing:
        raise ValueError(
            f"launcher environment incomplete: {', '.join(missing)} not set\n"
            "- help: start the script with `gradhub run -n N script.py` or torchrun, "
            "or use gradhub.collective.local_group(rank, world_size, port)"
        )
    backend = _pick_backend(backend)
    rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    local_rank = int(environ.get("LOCAL_RANK", rank))
    td = timedelta(seconds=timeout)
    if env is None:
        # The env:// rendezvous also handles torchrun's agent-hosted store.
        store, rank, world_size = next(dist.rendezvous("env://", timeout=td))
    else:
        store = dist.TCPStore(
            environ["MASTER_ADDR"],
            int(environ["MASTER_PORT"]),
            world_size,
            is_master=rank == 0,
            timeout=td,
        )
    return _start(store, rank, world_size, backend, timeout, local_rank)


def local_group(
    rank: int,
    world_size: int,
    port: int,
    *,
    backend: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> CollectiveGroup:
    """Set up the default process group on 127.0.0.1:``port`` (rank 0 hosts the store).

    For tests, examples and benchmarks: every rank calls it with the same
    ``world_size`` and ``port`` (see :func:`free_loopback_port`). Use it as a
    context manager to tear the group down.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    backend = _pick_backend(backend)
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout)
    )
    return _start(store, rank, world_size, backend, timeout, rank)


def destroy_process_group() -> None:
    """Close every gradhub group of this process and destroy the default process group."""
    for group in list(_GROUPS.values()):
        group.close()
    if dist.is_initialized():
        dist.destroy_process_group()
