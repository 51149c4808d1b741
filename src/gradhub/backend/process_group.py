""":class:`GradhubProcessGroup`: the ``dist.ProcessGroup`` torch gets for ``"gradhub"``.

Every collective returns its work (:mod:`gradhub.backend.work`) at once and
runs on the group's one worker thread, in call order (the same order on
every rank, as torch requires), so DDP's bucket all-reduces overlap the
backward pass as they do on gloo; one on gradhub's transports of at most
:data:`~gradhub.backend.group_base.IN_PLACE_BYTES` runs on the calling thread
instead where nothing is queued before it (its work is done on return: the
thread hand-offs would cost more than the operation). Point-to-point messages go straight to the
group's point-to-point gloo group, as gloo's own do. What runs where, and the
numerics, are in :mod:`gradhub.backend.operations`.

Decisions:

- Both method names where torch renamed one (``all_gather_single`` /
  ``_allgather_base``, ``reduce_scatter_single`` / ``_reduce_scatter_base``,
  ``all_to_all_single`` / ``alltoall_base``, and the coalesced forms): torch
  looks up either, by version.
- Every method checks its arguments first (:mod:`gradhub.backend.checks`):
  what gloo would refuse (and a CUDA tensor: gradhub's transports are host
  memory; use NCCL) is a :class:`~gradhub.errors.CollectiveArgumentError`
  raised from the call itself, before anything is queued or sent, and the
  group stays usable. (A mixed ``"cpu:gradhub,cuda:nccl"`` group is not
  possible: torch takes a Python process group as the whole group.)
- The group's timeout (``init_process_group(timeout=...)``) bounds every
  operation; a dead or stalled peer fails the work with gradhub's error naming
  the rank, and the group is broken afterwards (later operations raise
  :class:`~gradhub.errors.StateError`), as :class:`CollectiveGroup` decides.
- ``shutdown()`` (``destroy_process_group``) lets queued operations finish,
  closes the transports and destroys the inner gloo groups.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from gradhub.backend import operations as ops
from gradhub.backend.group_base import GroupBase, Tensors
from gradhub.backend.operations import Reduction
from gradhub.backend.work import GradhubWork, PeerWork

_SUM = Reduction.of(dist.ReduceOp.SUM)


class GradhubProcessGroup(GroupBase):
    """A process group whose collectives run on gradhub's transports.

    Made by torch (``dist.init_process_group("gradhub")``,
    ``dist.new_group(backend="gradhub")``) through
    :func:`gradhub.backend.registration.create`; not built by hand.
    """

    # ------------------------------------------------------------ all-reduce
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> GradhubWork:
        red = _SUM if opts is None else Reduction.of(opts.reduceOp)
        return self._all_reduce("allreduce", tensors, red)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> GradhubWork:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._all_reduce("allreduce_coalesced", tensors, Reduction.of(opts.reduceOp))

    def _all_reduce(self, name: str, tensors: Tensors, red: Reduction) -> GradhubWork:
        if not (plain := ops.plain_sum(tensors, red)):  # else every check passes: none run
            call = self._call(name)
            call.tensors(tensors)
            if name == "allreduce_coalesced":
                call.same_dtype(tensors)
            else:
                call.alike(tensors[1:], tensors[0], "tensor")
            call.reduction(tensors, red)
        if plain or ops.on_transport(tensors, red):
            return self._submit(
                name,
                list(tensors),
                lambda: ops.transport_all_reduce(self._ctx, name, tensors, red),
                ops.nbytes(tensors),
            )

        def gloo(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            ops.premultiply(outs, red)
            if name == "allreduce_coalesced":  # gloo's allreduce would reduce the list too
                coalesced = dist.AllreduceCoalescedOptions()
                coalesced.reduceOp = red.gloo_op()
                return pg.allreduce_coalesced(outs, coalesced)
            options = dist.AllreduceOptions()
            options.reduceOp = red.gloo_op()
            return pg.allreduce(outs, options)

        return self._gloo(name, [], tensors, gloo)

    # ------------------------------------------------------------- broadcast
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> GradhubWork:
        opts = opts if opts is not None else dist.BroadcastOptions()
        call = self._call("broadcast")
        call.tensors(tensors)
        call.alike(tensors[1:], tensors[0], "tensor")
        call.root(opts.rootRank, len(tensors), opts.rootTensor)
        if len(tensors) == 1 and tensors[0].layout == torch.strided:
            (stand_in,), copied = ops.contiguous(tensors)

            def body() -> None:
                ops.transport_broadcast(self._ctx, "broadcast", stand_in, opts.rootRank)
                ops.copy_back(tensors, [stand_in], copied)

            return self._submit("broadcast", list(tensors), body, ops.nbytes(tensors))
        return self._gloo(
            "broadcast",
            [],
            tensors,
            lambda pg, _, outs: pg.broadcast(outs, opts),
            peer=opts.rootRank,
        )

    # ------------------------------------------------------------ all-gather
    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> GradhubWork:
        opts = opts if opts is not None else AllgatherOptions()
        flat_out = [t for outs in output_tensors for t in outs]
        call = self._call("allgather")
        call.tensors(input_tensors)
        call.tensors(flat_out, empty=True)
        call.count(output_tensors, len(input_tensors), "the output list")
        for i, outs in enumerate(output_tensors):
            call.count(outs, self._size, f"output list {i}")
            call.alike(outs, input_tensors[i], "output")
        if len(input_tensors) == 1 and ops.on_transport([*input_tensors, *flat_out]):
            outs, inp = output_tensors[0], input_tensors[0]
            return self._submit(
                "allgather",
                flat_out,
                lambda: ops.transport_all_gather(self._ctx, "allgather", outs, inp),
                ops.nbytes(flat_out),
            )
        width = len(output_tensors[0]) if output_tensors else 0

        def gloo(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            nested = [outs[i * width : (i + 1) * width] for i in range(len(output_tensors))]
            return pg.allgather(nested, ins, opts)

        return self._gloo("allgather", input_tensors, flat_out, gloo)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> GradhubWork:
        opts = opts if opts is not None else AllgatherOptions()
        call = self._call("all_gather_single")
        call.tensors([output, input])
        call.concatenated(output, input, "the output")
        if ops.on_transport([output, input]):
            return self._submit(
                "all_gather_single",
                [output],
                lambda: ops.transport_all_gather(self._ctx, "all_gather_single", [output], input),
                ops.nbytes([output]),
            )
        return self._gloo(
            "all_gather_single",
            [input],
            [output],
            lambda pg, ins, outs: pg._allgather_base(outs[0], ins[0], opts),
        )

    _allgather_base = all_gather_single

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: Any = None,
    ) -> GradhubWork:
        """``output_lists[r][i]`` = rank ``r``'s ``input_list[i]``."""
        call = self._call("allgather_coalesced")
        call.tensors(input_list)
        call.count(output_lists, self._size, "the output list")
        for r, outs in enumerate(output_lists):
            call.tensors(outs)
            call.count(outs, len(input_list), f"output list {r}")
            for i, (o, t) in enumerate(zip(outs, input_list, strict=True)):
                call.fits(o, t, f"output {i} of rank {r}")
        works = [
            self.allgather([[outs[i] for outs in output_lists]], [t], opts)
            for i, t in enumerate(input_list)
        ]
        return self._after("allgather_coalesced", works, [t for o in output_lists for t in o])

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> GradhubWork:
        call = self._call("all_gather_single_coalesced")
        call.count(outputs, len(inputs), "the output list")
        for o, i in zip(outputs, inputs, strict=True):
            call.tensors([o, i])
            call.concatenated(o, i, "an output")
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return self._after("all_gather_single_coalesced", works, list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]

    # -------------------------------------------------------- reduce-scatter
    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        red = Reduction.of(opts.reduceOp)
        flat_in = [t for ins in input_tensors for t in ins]
        call = self._call("reduce_scatter")
        call.tensors(output_tensors)
        call.tensors(flat_in, empty=True)
        call.count(input_tensors, len(output_tensors), "the input list")
        for i, ins in enumerate(input_tensors):
            call.count(ins, self._size, f"input list {i}")
            call.alike(ins, output_tensors[i], "input")
        call.reduction(output_tensors, red)
        if len(output_tensors) == 1 and ops.on_transport([*output_tensors, *flat_in], red):
            out, chunks = output_tensors[0], input_tensors[0]
            return self._submit(
                "reduce_scatter",
                [out],
                lambda: ops.transport_reduce_scatter(self._ctx, "reduce_scatter", out, chunks, red),
                ops.nbytes(flat_in),
            )
        width = len(input_tensors[0]) if input_tensors else 0

        def gloo(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            ins = [t.clone() for t in ins] if red.is_premul else ins
            ops.premultiply(ins, red)
            options = dist.ReduceScatterOptions()
            options.reduceOp = red.gloo_op()
            nested = [ins[i * width : (i + 1) * width] for i in range(len(input_tensors))]
            return pg.reduce_scatter(outs, nested, options)

        return self._gloo("reduce_scatter", flat_in, output_tensors, gloo)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        red = Reduction.of(opts.reduceOp)
        name = "reduce_scatter_single"
        call = self._call(name)
        call.tensors([output, input])
        call.concatenated(input, output, "the input")
        call.reduction([output], red)
        if ops.on_transport([output, input], red):
            chunks = list(input.reshape(-1).chunk(self._size))
            return self._submit(
                name,
                [output],
                lambda: ops.transport_reduce_scatter(self._ctx, name, output, chunks, red),
                ops.nbytes([input]),
            )

        def gloo(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            source = ins[0].clone() if red.is_premul else ins[0]
            ops.premultiply([source], red)
            options = dist.ReduceScatterOptions()
            options.reduceOp = red.gloo_op()
            return pg._reduce_scatter_base(outs[0], source, options)

        return self._gloo(name, [input], [output], gloo)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> GradhubWork:
        call = self._call("reduce_scatter_single_coalesced")
        call.count(inputs, len(outputs), "the input list")
        red = Reduction.of((opts if opts is not None else dist.ReduceScatterOptions()).reduceOp)
        for o, i in zip(outputs, inputs, strict=True):
            call.tensors([o, i])
            call.concatenated(i, o, "an input")
            call.reduction([o], red)
        works = [
            self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._after("reduce_scatter_single_coalesced", works, list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

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
        call = self._call("all_to_all_single")
        call.tensors([output, input])
        call.same_dtype([output, input])
        if output_split_sizes or input_split_sizes:
            call.splits(output_split_sizes, output, "the output")
            call.splits(input_split_sizes, input, "the input")
        elif output.numel() != input.numel():
            raise call.refuse(
                f"the output has {output.numel()} elements and the input {input.numel()}",
                "without split sizes both have the same number of elements",
            )
        return self._gloo(
            "all_to_all_single",
            [input],
            [output],
            lambda pg, ins, outs: pg.alltoall_base(
                outs[0], ins[0], output_split_sizes, input_split_sizes, opts
            ),
        )

    alltoall_base = all_to_all_single  # type: ignore[assignment]

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.AllToAllOptions()
        call = self._call("alltoall")
        call.tensors([*output_tensors, *input_tensors])
        call.count(input_tensors, self._size, "the input list")
        call.count(output_tensors, self._size, "the output list")
        call.same_dtype([*output_tensors, *input_tensors])
        return self._gloo(
            "alltoall",
            input_tensors,
            output_tensors,
            lambda pg, ins, outs: pg.alltoall(outs, ins, opts),
        )

    # ------------------------------------------------- rooted and barrier
    def barrier(self, opts: Any = None) -> GradhubWork:
        """Every rank enters before any leaves: a one-element sum on gradhub's
        transports, in call order behind the operations before it (on one
        host the ranks leave within microseconds of each other, on the calling
        thread where the worker is idle), bounded by the group's timeout; with a
        timeout of its own (``dist.barrier(timeout=...)``), gloo's barrier."""
        opts = opts if opts is not None else dist.BarrierOptions()
        if opts.timeout >= timedelta(0):  # torch's default is "unset": -1 ms
            return self._gloo("barrier", [], [], lambda pg, _, __: pg.barrier(opts))
        token = torch.zeros(1)
        return self._submit(
            "barrier",
            [],
            lambda: ops.transport_all_reduce(self._ctx, "barrier", [token], _SUM),
            ops.nbytes([token]),
        )

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> GradhubWork:
        opts = opts if opts is not None else dist.ReduceOptions()
        red = Reduction.of(opts.reduceOp)
        call = self._call("reduce")
        call.tensors(tensors)
        call.alike(tensors[1:], tensors[0], "tensor")
        call.root(opts.rootRank, len(tensors), opts.rootTensor)
        call.reduction(tensors, red)

        def gloo(pg: dist.ProcessGroup, _: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            ops.premultiply(outs, red)
            options = dist.ReduceOptions()
            options.reduceOp = red.gloo_op()
            options.rootRank, options.rootTensor = opts.rootRank, opts.rootTensor
            return pg.reduce(outs, options)

        return self._gloo("reduce", [], tensors, gloo, peer=opts.rootRank)

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.GatherOptions()
        flat_out = [t for outs in output_tensors for t in outs]
        call = self._call("gather")
        call.tensors(input_tensors)
        call.tensors(flat_out, empty=True)
        call.root(opts.rootRank)
        call.count(input_tensors, 1, "the input list")
        call.count(output_tensors, 1 if self._rank == opts.rootRank else 0, "the output list")
        for outs in output_tensors:
            call.count(outs, self._size, "the root's output list")
            call.alike(outs, input_tensors[0], "output")
        width = len(output_tensors[0]) if output_tensors else 0

        def gloo(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            nested = [outs[i * width : (i + 1) * width] for i in range(len(output_tensors))]
            return pg.gather(nested, ins, opts)

        return self._gloo("gather", input_tensors, flat_out, gloo, peer=opts.rootRank)

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.ScatterOptions()
        flat_in = [t for ins in input_tensors for t in ins]
        call = self._call("scatter")
        call.tensors(output_tensors)
        call.tensors(flat_in, empty=True)
        call.root(opts.rootRank)
        call.count(output_tensors, 1, "the output list")
        call.count(input_tensors, 1 if self._rank == opts.rootRank else 0, "the input list")
        for ins in input_tensors:
            call.count(ins, self._size, "the root's input list")
            call.alike(ins, output_tensors[0], "input")
        width = len(input_tensors[0]) if input_tensors else 0

        def gloo(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            nested = [ins[i * width : (i + 1) * width] for i in range(len(input_tensors))]
            return pg.scatter(outs, nested, opts)

        return self._gloo("scatter", flat_in, output_tensors, gloo, peer=opts.rootRank)

    # -------------------------------------------------------- point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        self._call("send").tensors(tensors)
        work = self._p2p.send([t.contiguous() for t in tensors], dst, tag)
        return PeerWork(work, "send", self._rank, dst, self._timeout)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        call = self._call("recv")
        call.tensors(tensors)
        for t in tensors:
            if not t.is_contiguous():
                raise call.refuse(
                    "the tensor to receive into must be contiguous",
                    "receive into t.contiguous() and copy it where it belongs",
                )
        return PeerWork(self._p2p.recv(tensors, src, tag), "recv", self._rank, src, self._timeout)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        self._call("recv").tensors(tensors)
        work = self._p2p.recv_anysource(tensors, tag)
        return PeerWork(work, "recv", self._rank, None, self._timeout)
