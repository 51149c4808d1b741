"""``gradhub.init()``: join the job the launcher started.

A training script calls :func:`init` once. It reads torchrun's standard
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``) and nothing else, sets up the default process group (gloo on
CPU, NCCL on GPU) with an explicit timeout, and returns a :class:`Runtime`
that strategies and the trainer take their rank, device and store from.

Decisions:
- Without ``RANK``/``WORLD_SIZE`` (a plain ``python script.py``) the job is one
  process: a world-size-1 group on an in-memory store, so every strategy runs
  the same code path with nothing to launch.
- A group that is already initialised (by the user or an earlier ``init``) is
  adopted, not re-created; :meth:`Runtime.close` then leaves it alone.
- The c10d store is exposed because it is how ranks find out about each other
  beyond collectives: which ranks are still alive after a failure
  (:meth:`Runtime.failed_ranks`) and the parameter-server addresses that
  ``gradhub run --servers`` publishes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradhub.collective.group import destroy_process_group, init_process_group_from_env
from gradhub.errors import ClosedError, CollectiveTimeoutError, GradhubError, WorkerFailedError

log = logging.getLogger(__name__)

_ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


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
    """Where the model and batches go."""
    backend: str
    """c10d backend of the default group: ``"gloo"`` or ``"nccl"``."""
    timeout: float
    """Seconds any collective may take before it is an error."""
    store: dist.Store = field(repr=False)
    """The c10d key-value store shared by every rank of the job."""
    owns_group: bool = field(default=True, repr=False)
    _closed: bool = field(default=False, repr=False)
    _failures: int = field(default=0, repr=False)

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

    def failed_ranks(self, tag: str, *, grace: float | None = None) -> list[int]:
        """Ranks that did not check in under ``tag`` within ``grace`` seconds.

        Called by every surviving rank after a collective failed: each one
        writes ``tag/<rank>`` into the store and waits for the others. Ranks
        that never write are the dead (or hung) ones. If the store itself is
        gone, the rank hosting it (rank 0 under a plain ``env://`` set-up) is
        reported.
        """
        grace = min(5.0, self.timeout) if grace is None else grace
        key = f"gradhub/alive/{tag}"
        try:
            self.store.set(f"{key}/{self.rank}", "1")
            deadline = time.monotonic() + grace
            missing = list(range(self.world_size))
            while True:
                missing = [r for r in missing if not self.store.check([f"{key}/{r}"])]
                if not missing or time.monotonic() >= deadline:
                    return missing
                time.sleep(0.05)
        except (RuntimeError, dist.DistError) as exc:  # the store's host is gone
            log.debug("rank %d: store unreachable while checking liveness: %s", self.rank, exc)
            return [0] if self.rank != 0 else []

    def failure(self, operation: str, exc: BaseException, *, where: str = "") -> Exception:
        """Turn a failed collective into an error that names the rank(s) responsible.

        Every surviving rank calls this; see :meth:`failed_ranks`. ``where``
        (e.g. ``"step 12"``) makes the message and the liveness tag specific.
        """
        self._failures += 1
        dead = self.failed_ranks(f"{operation}/{where}/{self._failures}")
        at = f"{operation} at {where}" if where else operation
        if dead:
            ranks = ", ".join(str(r) for r in dead)
            return WorkerFailedError(
                f"rank(s) {ranks} died or stopped answering during {at}\n"
                f"- help: check the log of rank(s) {ranks}; resume from the last checkpoint"
            )
        text = str(exc).lower()
        if "timed out" in text or "timeout" in text:
            return CollectiveTimeoutError(operation, [], self.timeout, detail=str(exc))
        return WorkerFailedError(f"{at} failed: {exc}")

    def wait(self, work: Any, operation: str, *, where: str = "") -> None:
        """Wait for an asynchronous c10d work item, at most :attr:`timeout` seconds."""
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except Exception as exc:
            raise self.failure(operation, exc, where=where) from exc

    def all_reduce_sum(self, tensor: torch.Tensor, *, where: str = "") -> torch.Tensor:
        """Sum ``tensor`` over every rank in place (bounded wait); returns it."""
        if self.world_size > 1:
            self.wait(dist.all_reduce(tensor, async_op=True), "all_reduce", where=where)
        return tensor

    def close(self) -> None:
        """Destroy the process group (if this runtime created it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.owns_group:
            destroy_process_group()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise GradhubError(f"environment variable {name}={raw!r} is not an integer") from None


def _pick_backend(backend: str | None) -> str:
    if backend is not None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend 'nccl' needs CUDA, which this machine lacks; use 'gloo'")
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def _init_process_group(backend: str, timeout: float, launched: bool) -> None:
    """Create the default group: from the launcher's env, or alone on a local store."""
    if launched:
        init_process_group_from_env(backend=backend, timeout=timeout)
    else:
        td = timedelta(seconds=timeout)
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=td)


def init(*, backend: str | None = None, timeout: float = 60.0) -> Runtime:
    """Join the job: read torchrun's environment and set up the process group.

    ``backend`` defaults to NCCL when CUDA is available and gloo otherwise.
    ``timeout`` bounds every collective of the job (seconds); a rank that
    stops answering makes the others fail within it instead of hanging.
    """
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    backend = _pick_backend(backend)
    launched = "RANK" in os.environ or "WORLD_SIZE" in os.environ
    rank = _env_int("RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    local_rank = _env_int("LOCAL_RANK", rank)
    if launched:
        missing = [k for k in _ENV_KEYS if k != "LOCAL_RANK" and k not in os.environ]
        if missing:
            raise GradhubError(
                f"launcher environment incomplete: {', '.join(missing)} not set\n"
                "- help: start the script with `gradhub run -n N script.py` or `torchrun`"
            )
    if not 0 <= rank < world_size:
        raise GradhubError(f"RANK={rank} is outside [0, WORLD_SIZE={world_size})")

    owns = not dist.is_initialized()
    if owns:
        _init_process_group(backend, timeout, launched)
    else:
        backend = str(dist.get_backend())
        rank, world_size = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()

    if backend == "nccl":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    runtime = Runtime(
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=backend,
        timeout=timeout,
        store=store,
        owns_group=owns,
    )
    log.debug("rank %d: joined %s", rank, runtime)
    return runtime
