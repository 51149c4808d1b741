""":class:`GradhubProcessGroup`: the ``dist.ProcessGroup`` torch gets for ``"gradhub"``.

Every collective returns its :class:`~gradhub.backend.work.GradhubWork` at once
and runs on the group's one worker thread, in call order (the same order on
every rank, as torch requires), so DDP's bucket all-reduces overlap the
backward pass as they do on gloo. Point-to-point messages go straight to the
group's point-to-point gloo group, as gloo's own do. What runs where, and the
numerics, are in :mod:`gradhub.backend.operations`.

Decisions:

- Both method names where torch renamed one (``all_gather_single`` /
  ``_allgather_base``, ``reduce_scatter_single`` / ``_reduce_scatter_base``,
  ``all_to_all_single`` / ``alltoall_base``, and the coalesced forms): torch
  looks up either, by version.
- A CUDA tensor is an :class:`~gradhub.errors.UnsupportedTensorError` raised
  from the call itself (gradhub's transports are host memory); it says to use
  NCCL (``init_process_group("cpu:gradhub,cuda:nccl")`` for both).
- The group's timeout (``init_process_group(timeout=...)``) bounds every
  operation; a dead or stalled peer fails the work with gradhub's error naming
  the rank, and the group is broken afterwards (later operations raise
  :class:`~gradhub.errors.StateError`), as :class:`CollectiveGroup` decides.
- ``shutdown()`` (``destroy_process_group``) lets queued operations finish,
  closes the transports and destroys the inner gloo groups.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradhub.backend import operations as ops
from gradhub.backend.operations import Context, Reduction
from gradhub.backend.work import GradhubWork
from gradhub.collective import CollectiveGroup
from gradhub.errors import ClosedError, UnsupportedTensorError

_log = logging.getLogger("gradhub.backend")

Tensors = Sequence[torch.Tensor]


def _check_cpu(name: str, tensors: Tensors) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise UnsupportedTensorError(
                f"{name}: the gradhub backend takes CPU tensors, got one on {t.device}\n"
                '- help: use NCCL for GPU tensors: dist.init_process_group("nccl"), or '
                '"cpu:gradhub,cuda:nccl" for both'
            )


class GradhubProcessGroup(dist.ProcessGroup):  # type: ignore[misc]
    """A process group whose collectives run on gradhub's transports.

    Made by torch (``dist.init_process_group("gradhub")``,
    ``dist.new_group(backend="gradhub")``) through
    :func:`gradhub.backend.registration.create`; not built by hand.
    """

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
        super().__init__(rank, size)  # the (store, rank, size) form is no subclass in 2.13
        self._rank = rank
        self._size = size
        self._timeout = timeout.total_seconds()
        self._p2p = p2p
        self._collectives = collectives
        self._store = store
        self._context: Context | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"gradhub-backend-r{rank}"
        )
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
        return getattr(self._context.group.transport_choice, "name", None)

    # ------------------------------------------------------------ machinery
    @property
    def _ctx(self) -> Context:
        """The transports' group, made at the first operation (on the worker
        thread): torch's rank lookups need the default group, which does not
        exist yet while torch builds this one."""
        if self._context is None:
            group = CollectiveGroup(
                self._collectives,
                store=dist.PrefixStore("gradhub/", self._store),
                timeout=self._timeout,
            )
            self._context = Context(group, self._collectives)
        return self._context

    def _submit(
        self, name: str, outputs: list[torch.Tensor], body: Callable[[], None]
    ) -> GradhubWork:
        if self._closed:
            raise ClosedError(f"[rank {self._rank}] {name}: the gradhub process group is closed")
        work = GradhubWork(name, self._rank, self._timeout, outputs)

        def run() -> None:
            work._start()
            try:
                body()
            except BaseException as exc:
                work._finish(exc)
            else:
                work._finish()

        self._executor.submit(run)
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

    # ------------------------------------------------------------ all-reduce
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> GradhubWork:
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._all_reduce("allreduce", tensors, Reduction.of(opts.reduceOp))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> GradhubWork:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._all_reduce("allreduce_coalesced", tensors, Reduction.of(opts.reduceOp))

    def _all_reduce(self, name: str, tensors: Tensors, red: Reduction) -> GradhubWork:
        _check_cpu(name, tensors)
        if ops.on_transport(tensors, red):
            return self._submit(
                name, list(tensors), lambda: ops.transport_all_reduce(self._ctx, tensors, red)
            )

        def call(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            ops.premultiply(outs, red)
            options = dist.AllreduceOptions()
            options.reduceOp = red.gloo_op()
            return pg.allreduce(outs, options)

        return self._gloo(name, [], tensors, call)

    # ------------------------------------------------------------- broadcast
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> GradhubWork:
        opts = opts if opts is not None else dist.BroadcastOptions()
        _check_cpu("broadcast", tensors)
        return self._gloo(
            "broadcast",
            [],
            tensors,
            lambda pg, _, outs: pg.broadcast(outs, opts),
            peer=opts.rootRank,
        )

    # ------------------------------------------------------------ all-gather
    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        flat_out = [t for outs in output_tensors for t in outs]
        _check_cpu("allgather", [*input_tensors, *flat_out])
        if (
            len(input_tensors) == 1
            and ops.on_transport([*input_tensors, *flat_out])
            and all(o.numel() == input_tensors[0].numel() for o in flat_out)
        ):
            outs, inp = output_tensors[0], input_tensors[0]
            return self._submit(
                "allgather", flat_out, lambda: ops.transport_all_gather(self._ctx, outs, inp)
            )
        width = len(output_tensors[0]) if output_tensors else 0

        def call(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            nested = [outs[i * width : (i + 1) * width] for i in range(len(output_tensors))]
            return pg.allgather(nested, ins, opts)

        return self._gloo("allgather", input_tensors, flat_out, call)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.AllgatherOptions()
        _check_cpu("all_gather_single", [output, input])
        if ops.on_transport([output, input]) and output.numel() == input.numel() * self._size:
            return self._submit(
                "all_gather_single",
                [output],
                lambda: ops.transport_all_gather(self._ctx, [output], input),
            )
        return self._gloo(
            "all_gather_single",
            [input],
            [output],
            lambda pg, ins, outs: pg._allgather_base(outs[0], ins[0], opts),
        )

    _allgather_base = all_gather_single

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None
    ) -> GradhubWork:
        """``output_lists[r][i]`` = rank ``r``'s ``input_list[i]``."""
        works = [
            self.allgather([[outs[i] for outs in output_lists]], [t], opts)
            for i, t in enumerate(input_list)
        ]
        return self._after("allgather_coalesced", works, [t for o in output_lists for t in o])

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> GradhubWork:
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._after("all_gather_single_coalesced", works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # -------------------------------------------------------- reduce-scatter
    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        red = Reduction.of(opts.reduceOp)
        flat_in = [t for ins in input_tensors for t in ins]
        _check_cpu("reduce_scatter", [*output_tensors, *flat_in])
        if (
            len(output_tensors) == 1
            and ops.on_transport([*output_tensors, *flat_in], red)
            and all(t.numel() == output_tensors[0].numel() for t in flat_in)
        ):
            out, chunks = output_tensors[0], input_tensors[0]
            return self._submit(
                "reduce_scatter",
                [out],
                lambda: ops.transport_reduce_scatter(self._ctx, out, chunks, red),
            )
        width = len(input_tensors[0]) if input_tensors else 0

        def call(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            ins = [t.clone() for t in ins] if red.kind == ops.RedOp.PREMUL_SUM else ins
            ops.premultiply(ins, red)
            options = dist.ReduceScatterOptions()
            options.reduceOp = red.gloo_op()
            nested = [ins[i * width : (i + 1) * width] for i in range(len(input_tensors))]
            return pg.reduce_scatter(outs, nested, options)

        return self._gloo("reduce_scatter", flat_in, output_tensors, call)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        red = Reduction.of(opts.reduceOp)
        _check_cpu("reduce_scatter_single", [output, input])
        if ops.on_transport([output, input], red) and input.numel() == output.numel() * self._size:
            chunks = list(input.reshape(-1).chunk(self._size))
            return self._submit(
                "reduce_scatter_single",
                [output],
                lambda: ops.transport_reduce_scatter(self._ctx, output, chunks, red),
            )

        def call(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            source = ins[0].clone() if red.kind == ops.RedOp.PREMUL_SUM else ins[0]
            ops.premultiply([source], red)
            options = dist.ReduceScatterOptions()
            options.reduceOp = red.gloo_op()
            return pg._reduce_scatter_base(outs[0], source, options)

        return self._gloo("reduce_scatter_single", [input], [output], call)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> GradhubWork:
        works = [
            self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._after("reduce_scatter_single_coalesced", works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ------------------------------------------------------------ all-to-all
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        _check_cpu("all_to_all_single", [output, input])
        return self._gloo(
            "all_to_all_single",
            [input],
            [output],
            lambda pg, ins, outs: pg.alltoall_base(
                outs[0], ins[0], output_split_sizes, input_split_sizes, opts
            ),
        )

    alltoall_base = all_to_all_single

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        _check_cpu("alltoall", [*output_tensors, *input_tensors])
        return self._gloo(
            "alltoall",
            input_tensors,
            output_tensors,
            lambda pg, ins, outs: pg.alltoall(outs, ins, opts),
        )

    # ------------------------------------------------- rooted and barrier
    def barrier(self, opts: Any = None) -> GradhubWork:
        opts = opts if opts is not None else dist.BarrierOptions()
        return self._gloo("barrier", [], [], lambda pg, _, __: pg.barrier(opts))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> GradhubWork:
        opts = opts if opts is not None else dist.ReduceOptions()
        red = Reduction.of(opts.reduceOp)
        _check_cpu("reduce", tensors)

        def call(pg: dist.ProcessGroup, _: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            ops.premultiply(outs, red)
            options = dist.ReduceOptions()
            options.reduceOp = red.gloo_op()
            options.rootRank, options.rootTensor = opts.rootRank, opts.rootTensor
            return pg.reduce(outs, options)

        return self._gloo("reduce", [], tensors, call, peer=opts.rootRank)

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.GatherOptions()
        flat_out = [t for outs in output_tensors for t in outs]
        _check_cpu("gather", [*input_tensors, *flat_out])
        width = len(output_tensors[0]) if output_tensors else 0

        def call(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            nested = [outs[i * width : (i + 1) * width] for i in range(len(output_tensors))]
            return pg.gather(nested, ins, opts)

        return self._gloo("gather", input_tensors, flat_out, call, peer=opts.rootRank)

    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.ScatterOptions()
        flat_in = [t for ins in input_tensors for t in ins]
        _check_cpu("scatter", [*output_tensors, *flat_in])
        width = len(input_tensors[0]) if input_tensors else 0

        def call(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            nested = [ins[i * width : (i + 1) * width] for i in range(len(input_tensors))]
            return pg.scatter(outs, nested, opts)

        return self._gloo("scatter", flat_in, output_tensors, call, peer=opts.rootRank)

    # -------------------------------------------------------- point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        _check_cpu("send", tensors)
        return self._p2p.send([t.contiguous() for t in tensors], dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        _check_cpu("recv", tensors)
        for t in tensors:
            if not t.is_contiguous():
                raise UnsupportedTensorError(
                    "recv: the tensor to receive into must be contiguous\n"
                    "- help: receive into t.contiguous() and copy it where it belongs"
                )
        return self._p2p.recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        _check_cpu("recv", tensors)
        return self._p2p.recv_anysource(tensors, tag)

    # ---------------------------------------------------------------- misc
    def _after(self, name: str, works: list[GradhubWork], outputs: list[torch.Tensor]) -> GradhubWork:
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
        self._executor.shutdown(wait=True)
        if self._context is not None:
            self._context.group.close()
        from gradhub.backend.registration import destroy_inner

        for pg in (self._collectives, self._p2p):
            try:
                destroy_inner(pg)
            except (RuntimeError, ValueError) as exc:  # torch tears the world down itself
                _log.debug("[rank %d] inner group: %s", self._rank, exc)

    def abort(self) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"GradhubProcessGroup(rank={self._rank}, size={self._size}, timeout={self._timeout:g})"
