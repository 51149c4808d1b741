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
  place, :meth:`CollectiveGroup.failure`, through the check-in store. The
  runtime's own collectives are operations of its group
  (:meth:`Runtime.collective`: numbered, checked in, run in the group's
  order), and :meth:`Runtime.wait` waits on the operation's own future.
- The c10d store is exposed because it is how ranks find out about each other
  beyond collectives (check-ins, and the parameter-server addresses that
  ``gradhub run --servers`` publishes).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradhub.errors import (
    ClosedError,
    CollectiveTimeoutError,
    InvalidOptionError,
    LaunchEnvironmentError,
    RendezvousError,
    WorkerFailedError,
)
from gradhub.runtime.membership import (
    MEMBER_ENV,
    SURVIVE_ENV,
    BatchShare,
    Membership,
    Regrouped,
    abandon,
    join,
    rebuild,
)
from gradhub.runtime.setup import (
    BACKENDS,
    BOTH,
    DEFAULT_TIMEOUT,
    _check_timeout,
    _env_int,
    _launch_env,
    _start,
    destroy_process_group,
    free_loopback_port,
    init_process_group_from_env,
    local_group,
    pick_backend,
)
from gradhub.transports.choice import requested as requested_transport
from gradhub.transports.group import CollectiveFuture, CollectiveGroup, default_store

log = logging.getLogger(__name__)

__all__ = [
    "BACKENDS",
    "BOTH",
    "BatchShare",
    "DEFAULT_TIMEOUT",
    "Runtime",
    "current",
    "destroy_process_group",
    "free_loopback_port",
    "init",
    "init_process_group_from_env",
    "local_group",
    "pick_backend",
]


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
    survive: bool = False
    """Whether this worker outlives a peer's death (``gradhub run --survive``):
    the job goes on over the survivors (:meth:`regroup`)."""
    membership: Membership | None = field(default=None, repr=False)
    """The job's membership where it survives (:mod:`.membership`), else ``None``."""
    committed_steps: int = 0
    """Optimizer steps applied on this rank; a failed step of a surviving job is
    not counted (schedules computed from a step counter use this)."""
    transport: str | None = field(default=None, repr=False)
    replacement: bool = False
    """Whether this worker replaced a dead one and joined the running job."""
    joined: Regrouped | None = field(default=None, repr=False)
    """A replacement's agreement with the survivors it joined, until its strategy
    has taken their parameters and optimizer state (at set-up); else ``None``."""
    _closed: bool = field(default=False, repr=False)
    _listeners: list[Callable[[Regrouped], None]] = field(default_factory=list, repr=False)
    batches: deque[BatchShare] = field(default_factory=lambda: deque(maxlen=1024), repr=False)
    """The shares :class:`gradhub.GlobalBatchSampler` handed out and no backward has
    taken yet, oldest first (each synchronising backward takes one)."""

    def local_device(self, kind: str) -> torch.device:
        """This rank's device of ``kind`` (a script's ``--device``): for ``"cuda"``
        the GPU ``LOCAL_RANK`` picks (modulo the GPUs), whatever the backend;
        for ``"cpu"`` the CPU."""
        if kind == "cpu":
            return torch.device("cpu")
        if kind != "cuda" or not torch.cuda.is_available():
            raise InvalidOptionError(
                f"device must be 'cpu' or 'cuda' (with CUDA available), got {kind!r}"
            )
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

    def collective(
        self, operation: str, start: Callable[[], Any], *, where: str = ""
    ) -> CollectiveFuture[None]:
        """Run a c10d collective as an operation of :attr:`group`: ``start``
        issues it (``async_op=True``, on the default process group) on the
        group's worker thread, after the group's operations submitted before
        it, so every rank numbers it alike. The future returned is the
        operation's own; :meth:`wait` waits on it."""
        group, name = self.group, f"{operation} at {where}" if where else operation

        def run() -> None:
            op = group.begin(name)  # numbered and checked in: a timeout names who is behind
            group.wait(op, start(), None)

        return group.submit(name, run)

    def wait(self, work: Any, operation: str = "", *, where: str = "") -> None:
        """Wait for a collective, at most :attr:`timeout` seconds.

        ``work`` is the collective's own future where it has one (a
        :class:`~gradhub.transports.group.CollectiveFuture`: from
        :meth:`collective`, gradhub's collectives or a bucket reducer): its
        operation bounds the wait and names the ranks. A c10d work item
        started outside the group (a comm hook's, a reducer's) is waited as
        an operation of the group named ``operation``. A failure is a
        :class:`~gradhub.errors.WorkerFailedError` or
        :class:`~gradhub.errors.CollectiveTimeoutError` naming the rank(s)
        responsible; ``where`` (e.g. ``"step 12"``) makes the message specific.
        """
        if isinstance(work, CollectiveFuture):
            work.wait()
            return
        group, name = self.group, f"{operation} at {where}" if where else operation

        def run() -> None:
            group.wait(group.begin(name), work, None)

        group.call(name, run)

    def all_reduce_sum(self, tensor: torch.Tensor, *, where: str = "") -> torch.Tensor:
        """Sum ``tensor`` over every rank in place (bounded wait); returns it. A
        tensor on a device the group does not carry (a CPU count on an NCCL-only
        group) is summed on the group's device and copied back."""
        if self.world_size > 1:
            carried = tensor
            if self.group.backend_of(tensor.device) is None:
                carried = tensor.to(self.group.device)
            self.wait(
                self.collective(
                    "all_reduce", lambda: dist.all_reduce(carried, async_op=True), where=where
                )
            )
            if carried is not tensor:
                tensor.copy_(carried)
        return tensor

    @property
    def generation(self) -> int:
        """The membership generation this rank is in (0 without survival)."""
        return 0 if self.membership is None else self.membership.generation

    def on_regroup(self, fn: Callable[[Regrouped], None]) -> None:
        """Call ``fn`` after every :meth:`regroup`, on the new group (every rank
        registers the same listeners in the same order: they may communicate)."""
        self._listeners.append(fn)

    def regroup(self, cause: BaseException | None) -> Regrouped:
        """After a peer's death (``cause``) in a surviving job: leave the group,
        wait for the next membership, set up the group over the survivors, agree
        on the furthest state any of them committed and tell the listeners
        (:meth:`on_regroup`), which bring the ranks behind up to it. Without
        survival, ``cause`` is raised. ``cause=None``: a planned regroup at a
        step boundary (a replacement joins; every rank calls it after the same step)."""
        if self.membership is None:
            assert cause is not None
            raise cause
        if cause is not None:
            what = str(cause).split("\n")[0].split(". ")[0].removeprefix(f"[rank {self.rank}] ")
            log.warning("[rank %d] %s: regrouping over the survivors", self.rank, what)
        while True:
            if cause is not None:
                abandon(self.group, f"a peer died ({type(cause).__name__})")
            self.group.close()
            record = self.membership.next()
            try:
                self.group = rebuild(
                    self.membership, record, self.backend, self.timeout, self.transport
                )
                self.rank, self.world_size = self.group.rank, self.group.world_size
                done = Regrouped.agree(self.group, record, self.committed_steps)
                for fn in self._listeners:
                    fn(done)
            except (WorkerFailedError, CollectiveTimeoutError, RendezvousError) as exc:
                cause = exc  # another death while regrouping: the next generation
                continue
            self.committed_steps = done.committed_steps
            log.warning(
                "[rank %d] generation %d: %d worker(s) (members %s); continuing from step %d",
                self.rank,
                record.number,
                self.world_size,
                record.members,
                done.committed_steps,
            )
            return done

    def close(self) -> None:
        """Close the group; destroy the process group if this runtime created it.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.group.close()
        if self.membership is not None:
            self.membership.close()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_current: Runtime | None = None
"""The runtime :func:`init` returned last in this process."""


def init(
    *,
    backend: str | None = None,
    timeout: float | None = None,
    transport: str | None = None,
    survive: bool | None = None,
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
    across hosts. Every strategy of the job uses it. ``survive``: whether
    this worker outlives a peer's death (:attr:`Runtime.survive`); by
    default it does where ``gradhub run --survive`` started it, and
    ``survive=True`` anywhere else is a
    :class:`~gradhub.errors.LaunchEnvironmentError` (only that launcher keeps
    the survivors running).
    """
    _check_timeout(timeout)
    if transport is not None:
        requested_transport(transport)  # a wrong name fails before anything is set up
    if backend is not None:
        pick_backend(backend)  # a wrong name fails before anything is set up
    global _current
    if _current is not None and _current.survive and not _current.closed:
        return _current  # a surviving job's runtime outlives its process groups
    launched = "RANK" in os.environ or "WORLD_SIZE" in os.environ
    started_surviving = os.environ.get(SURVIVE_ENV) == "1"
    if survive and not started_surviving:
        raise LaunchEnvironmentError(
            "gradhub.init(survive=True) in a worker not started by `gradhub run --survive`: "
            "another launcher (torchrun's agent) stops every worker when one dies\n"
            "- help: start the job with `gradhub run -n N --survive script.py`"
        )
    membership, joined = None, None
    if started_surviving and survive is not False and not dist.is_initialized():
        limit = DEFAULT_TIMEOUT if timeout is None else float(timeout)
        local_rank = _launch_env(os.environ)[2]
        membership, group, joined = join(
            os.environ, int(os.environ[MEMBER_ENV]), pick_backend(backend), limit, transport
        )
    elif dist.is_initialized():
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
    store = membership.store if membership is not None else default_store()
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
        survive=membership is not None,
        membership=membership,
        transport=transport,
        joined=joined,
        replacement=joined is not None,
        committed_steps=joined.committed_steps if joined is not None else 0,
    )
    log.debug("rank %d: joined %s", runtime.rank, runtime)
    _current = runtime
    return runtime


def current() -> Runtime | None:
    """The runtime :func:`init` returned last in this process, while it is open."""
    return _current if _current is not None and not _current.closed else None
