"""The machinery of a gradhub process group: identity, worker thread, lifecycle.

:class:`GroupBase` is the ``dist.ProcessGroup`` subclass torch sees; it holds the
two inner gloo groups, builds the transports' :class:`~gradhub.collective.CollectiveGroup`
at the first operation, runs operation bodies in call order on its one worker
thread (small ones on the calling thread where nothing is queued) and answers
torch's name and description calls (DeviceMesh and FSDP2 need them).
:class:`~gradhub.backend.process_group.GradhubProcessGroup` adds the operations.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from gradhub.backend import operations as ops
from gradhub.backend.checks import Call
from gradhub.backend.operations import Context
from gradhub.backend.work import DoneWork, GradhubWork
from gradhub.collective import CollectiveGroup
from gradhub.errors import ClosedError
from gradhub.transports.choice import chosen
from gradhub.transports.worker import Worker

_log = logging.getLogger("gradhub.backend")

Tensors = Sequence[torch.Tensor]

IN_PLACE_BYTES = 8 << 20
"""The largest operation on gradhub's transports that runs on the calling
thread where the group's worker is idle (``benchmarks/backend.py``'s
all-reduce rows)."""


def destroy_inner(pg: dist.ProcessGroup) -> None:
    """Destroy an inner gloo group if torch still holds it (it may be tearing
    the whole world down itself)."""
    if pg in c10d._world.pg_map:
        dist.destroy_process_group(pg)


def _run(work: GradhubWork, body: Callable[[], None]) -> None:
    """Run an operation's ``body`` and finish its ``work`` with the outcome."""
    work._start()
    work._finish(_outcome(body))


def _outcome(body: Callable[[], None]) -> BaseException | None:
    """Run an operation's ``body``; its error, if any."""
    # Tensors may require grad (DDP with create_graph=True): the exchange is
    # data movement, as on gloo, never recorded.
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # torch.no_grad() costs several times more
    try:
        body()
    except BaseException as exc:
        return exc
    finally:
        torch._C._set_grad_enabled(grad)
    return None


class GroupBase(dist.ProcessGroup):
    """Identity, worker thread and lifecycle of a gradhub process group."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        *,
        timeout: timedelta,
        collectives: dist.ProcessGroup,
        p2p: dist.ProcessGroup,
    ):
        super().__init__(rank, size)  # type: ignore[call-arg]  # the (store, rank, size) form is no subclass in 2.13
        self._rank = rank
        self._size = size
        self._timeout = timeout.total_seconds()
        self._p2p = p2p
        self._collectives = collectives
        self._store = store
        self._context: Context | None = None
        self._worker = Worker(rank, name="gradhub-backend")
        self._group_name = ""
        self._group_desc = ""
        self._closed = False

    # ------------------------------------------------------------- identity
    def getBackendName(self) -> str:
        return "gradhub"

    def getRank(self) -> int:
        return self._rank

    def getSize(self) -> int:
        return self._size

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    @property
    def timeout(self) -> float:
        """Seconds any operation of this group may take."""
        return self._timeout

    @property
    def transport(self) -> str | None:
        """The transport gradhub chose for this group (``"shm"``, ``"hierarchical"``,
        ``"ring"``), once an operation has chosen it."""
        if self._context is None:
            return None
        return chosen(self._context.group)

    # ------------------------------------------------------------ machinery
    @property
    def _ctx(self) -> Context:
        """The transports' group, made at the first operation (on the thread
        that runs it): torch's rank lookups need the default group, which does
        not exist yet while torch builds this one."""
        if self._context is None:
            group = CollectiveGroup(
                self._collectives,
                store=dist.PrefixStore("gradhub/", self._store),
                timeout=self._timeout,
            )
            self._context = Context(group, self._collectives)
        return self._context

    def _call(self, name: str) -> Call:
        """The checks of one call of operation ``name`` (:mod:`.checks`)."""
        return Call(name, self._rank, self._size)

    def _submit(
        self,
        name: str,
        outputs: list[torch.Tensor],
        body: Callable[[], None],
        nbytes: int | None = None,
    ) -> GradhubWork:
        """Run ``body`` after every operation called before it; its work.

        ``nbytes``: the bytes of an operation on gradhub's transports. One of
        at most :data:`IN_PLACE_BYTES` runs on the calling thread where the
        worker is idle (:meth:`~gradhub.transports.worker.Worker.enter`): its
        work is done when the call returns, and the hand-off to the worker
        and back, which costs more than such an operation's own work, is
        saved. Anything else runs on the worker thread. So a small
        ``async_op=True`` call waits for the peers before it returns: a program
        that issues small collectives on two groups in different orders on
        different ranks (which torch does not forbid for asynchronous calls)
        waits until the group's timeout names the peer, where gloo would
        finish both.
        """
        if self._closed:
            raise ClosedError(f"[rank {self._rank}] {name}: the gradhub process group is closed")
        worker = self._worker
        if nbytes is not None and nbytes <= IN_PLACE_BYTES and worker.enter():
            try:
                error = _outcome(body)
            finally:
                worker.leave()
            if error is None:
                return DoneWork(name, outputs)
            work = GradhubWork(name, self._rank, self._timeout, outputs)
            work._finish(error)  # raised by wait(), as from the worker thread
            return work
        work = GradhubWork(name, self._rank, self._timeout, outputs)
        worker.submit(name, self._timeout, lambda: _run(work, body))
        return work

    def _gloo(
        self,
        name: str,
        inputs: Tensors,
        outputs: Tensors,
        call: Callable[[dist.ProcessGroup, list[torch.Tensor], list[torch.Tensor]], Any],
        peer: int | None = None,
    ) -> GradhubWork:
        """An operation on the inner gloo group, through contiguous stand-ins."""
        ins, _ = ops.contiguous(inputs)
        outs, copied = ops.contiguous(outputs)

        def body() -> None:
            ops.on_gloo(self._ctx, name, lambda pg: call(pg, ins, outs), peer)
            ops.copy_back(outputs, outs, copied)

        return self._submit(name, list(outputs), body)

    # ---------------------------------------------------------------- misc
    def _after(
        self, name: str, works: list[GradhubWork], outputs: list[torch.Tensor]
    ) -> GradhubWork:
        """One work that finishes when ``works`` (queued before it) have."""

        def body() -> None:
            for w in works:
                w.wait()

        return self._submit(name, outputs, body)

    def shutdown(self) -> None:
        """Let queued operations finish, close the transports, destroy the gloo groups."""
        if self._closed:
            return
        self._closed = True
        self._worker.shutdown()
        if self._context is not None:
            self._context.group.close()
        for pg in (self._collectives, self._p2p):
            try:
                destroy_inner(pg)
            except (RuntimeError, ValueError) as exc:  # torch tears the world down itself
                _log.debug("[rank %d] inner group: %s", self._rank, exc)

    def abort(self) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return (
            f"GradhubProcessGroup(rank={self._rank}, size={self._size}, timeout={self._timeout:g})"
        )
