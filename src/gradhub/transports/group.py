"""Process-group wrapper: one timeout, check-ins, failures that name the rank.

:class:`CollectiveGroup` wraps one ``torch.distributed`` process group with
what gradhub's collectives need around it: the backend and device, one
timeout, a c10d store for check-ins, an operation counter and one worker
thread on which operations run in order (:mod:`.worker`). Setting a group up from the
launcher's environment is :mod:`gradhub.runtime`'s job.

Decisions:

- **Who owns the wrapper.** Whoever creates it: :func:`gradhub.runtime.init`
  keeps one in its :class:`~gradhub.runtime.Runtime` (``runtime.group``),
  :func:`~gradhub.runtime.local_group` returns one, and an object given a
  plain torch process group (or ``None``: the default one) wraps it for
  itself and closes its wrapper with itself. There is no registry. Operations
  of different wrappers of one process group are not ordered with respect to
  each other: objects used concurrently on one process group must share one
  wrapper (as torch requires one order of collectives per group).
- **Timeout.** A wrapper made here of a process group the user created uses
  that group's own timeout (``init_process_group(timeout=...)``), unless
  ``timeout=`` is given.
- **Check-in.** Each operation starts with the rank writing its sequence
  number under its own key in the store (overwritten: the store does not
  grow), under the wrapper's creation number, alike on every rank.
- **Naming who failed** (:meth:`CollectiveGroup.failure`, where c10d's errors
  of operations become gradhub's, through :mod:`.c10d_errors`):

  - an operation that runs out of time is a
    :class:`~gradhub.errors.CollectiveTimeoutError` naming the ranks that
    did not enter it (their check-in is behind), else the peer waited on;
    the rank leaves a note in the store that it gave up;
  - a lost connection whose cause is a peer that gave up on its own timeout
    (its note is in the store) is the same timeout error, naming the ranks
    that never entered the operation, not the peer that left;
  - any other lost connection is a roll call: every surviving rank answers
    in the store, and the ranks that do not answer within a few seconds are
    named in :class:`~gradhub.errors.WorkerFailedError` (they died or hang);
  - a check-in the store cannot take (its host died or left) is a
    :class:`~gradhub.errors.WorkerFailedError` naming the store's address,
    raised before the operation starts.
- **A failure breaks the group.** Messages of the failed operation may still
  be in flight: later operations raise :class:`~gradhub.errors.StateError`.
  Ranks in errors are the group's (global ranks for the default group).
- **Close lets go of the process group** (and destroys it when this wrapper
  set it up), so gloo's threads end before the interpreter's exit.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gradhub.errors import (
    BrokenGroupError,
    ClosedError,
    CollectiveTimeoutError,
    StateError,
    WorkerFailedError,
)
from gradhub.transports.base import Transport
from gradhub.transports.c10d_errors import RESTART, is_timeout, ranks_named, translate
from gradhub.transports.operation import CollectiveFuture, Operation
from gradhub.transports.stores import (
    default_store,
    device_backends,
    process_group_timeout,
    roll_call,
    store_name,
)
from gradhub.transports.worker import Worker

__all__ = ["CollectiveFuture", "CollectiveGroup", "Operation", "default_store"]

_log = logging.getLogger("gradhub.collective")

T = TypeVar("T")


class CollectiveGroup:
    """A process group plus what gradhub's collectives need around it.

    Build one with :func:`gradhub.runtime.local_group`,
    :func:`gradhub.runtime.init_process_group_from_env`, ``gradhub.init().group``
    or :meth:`of` (which wraps an existing torch process group, or the
    default one). Its operation counter must advance in step on every rank,
    so every rank must run the same operations on it in the same order.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup,
        *,
        store: dist.Store | None,
        timeout: float,
        owns_process_group: bool = False,
        transport: str | None = None,
    ):
        self._process_group: dist.ProcessGroup | None = process_group
        self.transport = transport
        """Requested transport (:mod:`.choice`); ``None``: ``GRADHUB_TRANSPORT`` or auto."""
        self.transport_choice: Transport | None = None
        """The :class:`~.base.Transport` chosen for this group (set once by :mod:`.choice`)."""
        self.device_transport: Transport | None = None
        """The transport of CUDA tensors where a backend of their own carries them
        (NCCL in a ``"cpu:gloo,cuda:nccl"`` group; set once by :mod:`.choice`)."""
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.backend = str(dist.get_backend(process_group))
        """torch's name of the backend: ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``, ..."""
        self.backends = device_backends(self.backend)
        """Device type -> the backend that carries its tensors (:func:`.stores.device_backends`)."""
        cpu = "cpu" in self.backends
        self.device = (
            torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
        )
        """Where the group's own tensors live: CPU where a backend carries CPU tensors."""
        self.timeout = float(timeout)
        self.store: dist.Store | None = None
        """This wrapper's own part of the job's c10d store (``None``: no store)."""
        self._base_store = store
        if store is not None:
            name = getattr(process_group, "group_name", "default")
            base = f"gradhub/collective/{name}/"
            instance = store.add(f"{base}instances/{self.rank}", 1)
            self.store = dist.PrefixStore(f"{base}{instance}/", store)
        self._owns = owns_process_group
        self._sequence = 0
        self._lock = threading.Lock()
        self._worker = Worker(self.rank, alone=self.world_size == 1)
        self._broken: str | None = None
        self._broken_by_peer = False  # a peer's death or timeout broke it
        self._closed = False
        self._scratch: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}
        self._on_close: list[Callable[[], None]] = []
        self._check_in(0)

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The torch process group (let go at :meth:`close`)."""
        if self._process_group is None:
            raise ClosedError(f"[rank {self.rank}] the collective group is closed")
        return self._process_group

    def on_close(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` when the group closes (after its last operation)."""
        self._on_close.append(fn)

    # ----------------------------------------------------------------- set-up
    @classmethod
    def of(
        cls,
        group: CollectiveGroup | dist.ProcessGroup | None = None,
        *,
        timeout: float | None = None,
        transport: str | None = None,
    ) -> CollectiveGroup:
        """``group`` itself when it is a :class:`CollectiveGroup`, else a new
        wrapper of the torch process group ``group`` (default: the default one).

        The caller owns a new wrapper and closes it (see :meth:`borrow`).
        ``timeout`` and ``transport`` only apply to a new wrapper; the timeout
        defaults to the process group's own.
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
        store = default_store() if pg is dist.group.WORLD else None
        limit = process_group_timeout(pg) if timeout is None else float(timeout)
        return cls(pg, store=store, timeout=limit, transport=transport)

    def sibling(self) -> CollectiveGroup:
        """Another wrapper of the process group, with its own counter and check-ins."""
        return CollectiveGroup(self.process_group, store=self._base_store, timeout=self.timeout)

    @classmethod
    @contextlib.contextmanager
    def borrow(
        cls, group: CollectiveGroup | dist.ProcessGroup | None = None
    ) -> Iterator[CollectiveGroup]:
        """:meth:`of` for one block: a wrapper made here is closed at its end."""
        wrapper = cls.of(group)
        try:
            yield wrapper
        finally:
            if wrapper is not group:
                wrapper.close()

    # ------------------------------------------------------------- operations
    def begin(self, name: str, timeout: float | None = None, *, check_in: bool = True) -> Operation:
        """Start operation ``name``: check it is allowed, number it, check in
        (``check_in=False``: a transport that tells who entered by itself)."""
        self._check_open(name)
        if self._broken is not None:
            message = (
                f"[rank {self.rank}] {name}: the group is broken by an earlier failure "
                f"({self._broken}); destroy the process group and set it up again"
            )
            # A peer's death or silence is one still: survival regroups on it.
            raise (BrokenGroupError if self._broken_by_peer else StateError)(message)
        with self._lock:
            self._sequence += 1
            sequence = self._sequence
        if check_in:
            self._check_in(sequence)
        limit = self.timeout if timeout is None else float(timeout)
        return Operation(name, sequence, limit, time.monotonic() + limit)

    def wait(self, op: Operation, work: Any, peer: int | None) -> None:
        """Wait for ``work`` within ``op``'s deadline; ``peer`` is the rank it depends on.

        Raises :class:`CollectiveTimeoutError` or :class:`WorkerFailedError`
        naming the rank(s) responsible (see :meth:`failure`).
        """
        remaining = op.remaining()
        try:
            finished = work.wait(timedelta(seconds=max(remaining, 0.001)))
        except RuntimeError as exc:  # c10d's errors (DistError) are RuntimeErrors
            raise self.failure(op, peer, exc) from exc
        if finished is False:
            raise self.timed_out(op, peer)

    def failure(
        self, op: Operation, peer: int | None, exc: BaseException
    ) -> CollectiveTimeoutError | WorkerFailedError:
        """The gradhub error for a c10d error raised during ``op``: the ranks the
        check-ins and the roll call name, through :func:`.c10d_errors.translate`
        (a timeout at once); the group is broken after it."""
        if is_timeout(exc) or op.remaining() <= 0:
            return self.timed_out(op, peer)
        self._broken, self._broken_by_peer = f"{op.name} failed", True
        absent = self.missing_ranks(op.sequence)
        silent, gave_up = self._roll_call(op)
        if gave_up:
            # A peer ran out of time and left: the cause is whom it waited for.
            missing = absent or gave_up
            detail = f"{ranks_named(gave_up)} gave up waiting and left"
            if absent:
                detail = f"not entered the operation; {detail}"
            return self._log(CollectiveTimeoutError(op.name, missing, op.timeout, detail))
        what, timeout = f"[rank {self.rank}] {op.name}", op.timeout
        if silent:
            lost = f"{ranks_named(silent)} died or stopped answering"
            return self._log(translate(exc, what=what, timeout=timeout, ranks=silent, lost=lost))
        who = "a peer" if peer is None else f"rank {peer}"
        return self._log(
            translate(
                exc,
                what=what,
                timeout=timeout,
                lost=f"communication with {who} failed",
                help="every rank answered the roll call afterwards: the group is unusable; "
                "stop this process and restart the job",
            )
        )

    def timed_out(
        self, op: Operation, peer: int | None, absent: list[int] | None = None
    ) -> CollectiveTimeoutError:
        """The error of ``op`` timing out waiting on ``peer``; ``absent``: the
        ranks known not to have entered it (read from the check-ins when not given)."""
        self._broken, self._broken_by_peer = f"{op.name} timed out", True
        self._note(f"gave-up/{op.sequence}")
        if absent is None:
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
        return self._log(CollectiveTimeoutError(op.name, missing, op.timeout, detail))

    def mark_broken(self, reason: str, *, peer: bool = False) -> None:
        """Refuse every later operation: ``reason`` (e.g. ``"all_gather failed"``)
        left messages or shared state of an operation half done; ``peer``: a
        peer's death or silence did (later operations raise
        :class:`~gradhub.errors.BrokenGroupError`, else :class:`~gradhub.errors.StateError`)."""
        self._broken, self._broken_by_peer = reason, peer

    def _log(self, err: T) -> T:
        _log.error("[rank %d] %s", self.rank, err)
        return err

    def missing_ranks(self, sequence: int) -> list[int] | None:
        """Ranks whose last check-in is before operation ``sequence``; ``None`` when
        the store cannot be read (no store, or its host is gone)."""
        if self.store is None:
            return None
        missing = []
        try:
            for r in range(self.world_size):
                key = f"checkin/{r}"
                if not self.store.check([key]) or int(self.store.get(key)) < sequence:
                    missing.append(r)
        except (RuntimeError, ValueError) as exc:  # store host gone, or garbage
            _log.warning("[rank %d] cannot read check-ins: %s", self.rank, exc)
            return None
        return missing

    def _roll_call(self, op: Operation) -> tuple[list[int], list[int]]:
        """After a lost connection: :func:`.stores.roll_call` (silent ranks, quitters)."""
        if self.store is None:
            return [], []
        return roll_call(self.store, self.rank, self.world_size, op.sequence, op.timeout)

    def answer_roll_call(self, op: Operation) -> None:
        """Answer ``op``'s roll call ahead of it: this rank is alive and leaves
        ``op`` because it saw another rank fail (a transport that detects a
        dead peer by itself calls this), so ranks that then lose their
        connection to this one name the dead rank, not this one."""
        if self.store is None:
            return
        try:
            self.store.set(f"alive/{op.sequence}/{self.rank}", "1")
        except RuntimeError as exc:  # the store's host is gone
            _log.debug("[rank %d] cannot answer the roll call: %s", self.rank, exc)

    def _note(self, what: str) -> None:
        """Write ``what/<rank>`` (and this rank's roll-call answer) into the store."""
        if self.store is None:
            return
        sequence = what.rsplit("/", 1)[-1]
        try:
            self.store.set(f"{what}/{self.rank}", "1")
            self.store.set(f"alive/{sequence}/{self.rank}", "1")
        except RuntimeError as exc:
            _log.debug("[rank %d] cannot write %s: %s", self.rank, what, exc)

    def _check_in(self, sequence: int) -> None:
        if self.store is None:
            return
        try:
            self.store.set(f"checkin/{self.rank}", str(sequence))
        except RuntimeError as exc:  # c10d's DistNetworkError: the store's host is gone
            where = store_name(self._base_store)
            self._broken = f"{where} is unreachable"
            raise self._log(
                translate(
                    exc,
                    what=f"[rank {self.rank}] cannot check in to {where}",
                    timeout=self.timeout,
                    lost="the process that hosts it (rank 0 of a launched job) died or left",
                    help=f"check that process's log; {RESTART}",
                )
            ) from exc

    def submit(self, name: str, fn: Callable[[], T]) -> CollectiveFuture[T]:
        """Run ``fn`` on the group's worker thread, after every operation submitted
        before it; the same order on every rank keeps the ranks in step."""
        self._check_open(name)
        return self._worker.submit(name, self.timeout, fn)

    def call(self, name: str, fn: Callable[[], T]) -> T:
        """``submit(name, fn).wait()``, run on the calling thread where nothing is
        queued (see :class:`~.worker.Worker`)."""
        self._check_open(name)
        return self._worker.call(name, self.timeout, fn)

    def _check_open(self, name: str) -> None:
        if self._closed:
            raise ClosedError(f"[rank {self.rank}] {name}: the collective group is closed")

    def scratch(
        self, slot: str, numel: int, dtype: torch.dtype, device: torch.device | None = None
    ) -> torch.Tensor:
        """A reusable buffer of ``numel`` elements for ``slot`` on ``device``
        (default: the group's) (grown, never shrunk).

        For the bodies of operations, which run one at a time (:mod:`.worker`):
        fresh large buffers every call would cost a page fault per 4 KiB,
        as much as the transfer itself on a CPU. Never hand one to a caller.
        """
        where = self.device if device is None else device
        buf = self._scratch.get((slot, dtype, where))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=where)
            self._scratch[(slot, dtype, where)] = buf
        return buf[:numel]

    def backend_of(self, device: torch.device) -> str | None:
        """The backend that carries tensors on ``device`` in this group, or ``None``."""
        return self.backends.get(device.type)

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
        """Stop the worker thread (queued operations finish, each within its timeout),
        let go of the process group and destroy it if this wrapper set it up. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._worker.shutdown()
        for fn in self._on_close:
            fn()
        self._on_close.clear()
        self._scratch.clear()
        # Let go of the process group now, not at interpreter exit: a gloo thread
        # that frees its last operation's tensors then aborts the process.
        pg, self._process_group = self._process_group, None
        if self._owns and dist.is_initialized():
            dist.destroy_process_group(pg)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def owns_process_group(self) -> bool:
        """Whether :meth:`close` destroys the process group (this wrapper set it up)."""
        return self._owns

    def __enter__(self) -> CollectiveGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"CollectiveGroup(rank={self.rank}, world_size={self.world_size}, "
            f"backend={self.backend!r}, timeout={self.timeout:g})"
        )
