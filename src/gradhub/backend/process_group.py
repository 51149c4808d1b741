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
  NCCL. (A mixed ``"cpu:gradhub,cuda:nccl"`` group is not possible: torch
  takes a Python process group as the whole group.)
- The group's timeout (``init_process_group(timeout=...)``) bounds every
  operation; a dead or stalled peer fails the work with gradhub's error naming
  the rank, and the group is broken afterwards (later operations raise
  :class:`~gradhub.errors.StateError`), as :class:`CollectiveGroup` decides.
- ``shutdown()`` (``destroy_process_group``) lets queued operations finish,
  closes the transports and destroys the inner gloo groups.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from gradhub.backend import operations as ops
from gradhub.backend.group_base import GroupBase, Tensors, check_cpu
from gradhub.backend.operations import Reduction
from gradhub.backend.work import GradhubWork, PeerWork
from gradhub.errors import UnsupportedTensorError


class GradhubProcessGroup(GroupBase):
    """A process group whose collectives run on gradhub's transports.

    Made by torch (``dist.init_process_group("gradhub")``,
    ``dist.new_group(backend="gradhub")``) through
    :func:`gradhub.backend.registration.create`; not built by hand.
    """

    # ------------------------------------------------------------ all-reduce
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> GradhubWork:
        opts = opts if opts is not None else dist.AllreduceOptions()
        return self._all_reduce("allreduce", tensors, Reduction.of(opts.reduceOp))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> GradhubWork:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        return self._all_reduce("allreduce_coalesced", tensors, Reduction.of(opts.reduceOp))

    def _all_reduce(self, name: str, tensors: Tensors, red: Reduction) -> GradhubWork:
        check_cpu(name, tensors)
        if ops.on_transport(tensors, red):
            return self._submit(
                name, list(tensors), lambda: ops.transport_all_reduce(self._ctx, tensors, red)
            )

        def call(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            ops.premultiply(outs, red)
            if name == "allreduce_coalesced":  # gloo's allreduce would reduce the list too
                coalesced = dist.AllreduceCoalescedOptions()
                coalesced.reduceOp = red.gloo_op()
                return pg.allreduce_coalesced(outs, coalesced)
            options = dist.AllreduceOptions()
            options.reduceOp = red.gloo_op()
            return pg.allreduce(outs, options)

        return self._gloo(name, [], tensors, call)

    # ------------------------------------------------------------- broadcast
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> GradhubWork:
        opts = opts if opts is not None else dist.BroadcastOptions()
        check_cpu("broadcast", tensors)
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
        check_cpu("allgather", [*input_tensors, *flat_out])
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
        opts = opts if opts is not None else AllgatherOptions()
        check_cpu("all_gather_single", [output, input])
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
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: Any = None,
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
        check_cpu("reduce_scatter", [*output_tensors, *flat_in])
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
        check_cpu("reduce_scatter_single", [output, input])
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

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> GradhubWork:
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
        check_cpu("all_to_all_single", [output, input])
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
        check_cpu("alltoall", [*output_tensors, *input_tensors])
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
        check_cpu("reduce", tensors)

        def call(pg: dist.ProcessGroup, _: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            ops.premultiply(outs, red)
            options = dist.ReduceOptions()
            options.reduceOp = red.gloo_op()
            options.rootRank, options.rootTensor = opts.rootRank, opts.rootTensor
            return pg.reduce(outs, options)

        return self._gloo("reduce", [], tensors, call, peer=opts.rootRank)

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.GatherOptions()
        flat_out = [t for outs in output_tensors for t in outs]
        check_cpu("gather", [*input_tensors, *flat_out])
        width = len(output_tensors[0]) if output_tensors else 0

        def call(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            nested = [outs[i * width : (i + 1) * width] for i in range(len(output_tensors))]
            return pg.gather(nested, ins, opts)

        return self._gloo("gather", input_tensors, flat_out, call, peer=opts.rootRank)

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> GradhubWork:
        opts = opts if opts is not None else dist.ScatterOptions()
        flat_in = [t for ins in input_tensors for t in ins]
        check_cpu("scatter", [*output_tensors, *flat_in])
        width = len(input_tensors[0]) if input_tensors else 0

        def call(pg: dist.ProcessGroup, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> Any:
            nested = [ins[i * width : (i + 1) * width] for i in range(len(input_tensors))]
            return pg.scatter(outs, nested, opts)

        return self._gloo("scatter", flat_in, output_tensors, call, peer=opts.rootRank)

    # -------------------------------------------------------- point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        check_cpu("send", tensors)
        work = self._p2p.send([t.contiguous() for t in tensors], dst, tag)
        return PeerWork(work, "send", self._rank, dst, self._timeout)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        check_cpu("recv", tensors)
        for t in tensors:
            if not t.is_contiguous():
                raise UnsupportedTensorError(
                    "recv: the tensor to receive into must be contiguous\n"
                    "- help: receive into t.contiguous() and copy it where it belongs"
                )
        return PeerWork(self._p2p.recv(tensors, src, tag), "recv", self._rank, src, self._timeout)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        check_cpu("recv", tensors)
        work = self._p2p.recv_anysource(tensors, tag)
        return PeerWork(work, "recv", self._rank, None, self._timeout)
