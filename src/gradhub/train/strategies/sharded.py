"""``sharded``: synchronous training on AllReduceParameter, optimizer state sharded.

BigDL's scheme with ZeRO-1's memory saving, held to DDP's behaviour line by
line. The model's parameters become views of one flat fp32 vector, laid out
group by group in the order of the optimizer's parameter groups; rank r of P
owns slice r of it.

A synchronising backward (outside ``no_sync()``, or with
``model.require_backward_grad_sync`` true):

1. each parameter's accumulated ``.grad``, multiplied by this rank's weight
   (see :mod:`.base`), is written into a flat gradient vector, cut into
   buckets of about ``bucket_mb`` megabytes in the order backward produces
   them (the last parameters first); a full bucket's reduce-scatter starts at
   once on the group's communication thread, buckets strictly in the same
   order on every rank, optionally compressed on the wire
   (``compress="bf16"`` etc.) (:mod:`.sharded_buckets`). Each rank ends with
   the sum of its own slice: without compression the same bits as one
   reduce-scatter of the whole vector;
2. right behind each bucket's reduce-scatter, the bucket's summed parts are
   all-gathered back into its place in the flat vector, while the backward
   goes on (with ``set_samples(n)`` alone, whose sums are divided by a count
   known only at its end, after the backward); when backward ends every
   used parameter's ``.grad`` becomes a view of that vector. So after
   backward ``p.grad`` holds the full combined gradient, the same bits on
   every rank, as under DDP (torch's ``ZeroRedundancyOptimizer`` beside
   DDP keeps full gradients too and shards only the optimizer state).

The prepared optimizer's ``step``: the slice optimizer steps this rank's
pieces of the parameters with this rank's part of whatever ``.grad`` then
holds, so momentum or Adam state exists once across the job instead of once
per rank; then the updated slices are all-gathered straight into the flat
vector the parameters view. In the usual loop (nothing written to ``.grad``
between backward and step) both already ran during the backward, bucket by
bucket, aside, and ``step`` keeps them: the same bits (:mod:`.sharded_ahead`).

Decisions:
- Full gradients in ``.grad`` rather than distributed tensors (FSDP2's way):
  torch's own ``clip_grad_norm_(model.parameters(), c)``, ``GradScaler``
  (``unscale_`` in place, its inf check, skipped steps) and any code that
  reads or rewrites ``.grad`` between backward and step are right as
  written, and the result is DDP's. The price is one more all-gather per
  step (of the gradient, ``(P-1)/P`` of its bytes per rank) and a full
  gradient in memory on every rank, as under DDP. ``gradhub.clip_grad_norm_``
  is torch's clip over ``model.parameters()`` (the same bits as the
  script's own torch line, and the same on every rank).
- With a wire codec the gradient all-gather uses the gradient's codec too:
  the owner's slice is encoded and every rank, the owner included, decodes
  the same bytes, so every rank holds the same bits and the owner steps
  with the rounded sum everyone else sees. Under loss scaling the ``"fp16"``
  codec becomes the non-saturating one (:meth:`use_loss_scaling`): an
  overflow on either wire is inf in ``.grad``, found by the scaler.
- Unused parameters (DDP's ``find_unused_parameters=True``): a parameter
  whose ``.grad`` is None on every rank when backward ends keeps ``.grad``
  None (one small all-reduce of per-parameter flags per backward, queued
  behind the reduce-scatters); used on some ranks only, the others count
  as zeros. The slice optimizer holds one piece per parameter
  (:class:`~gradhub.collective.sharded_optimizer.Piece`) and a piece whose
  parameter has ``.grad`` None at ``step`` is not stepped: torch's optimizer
  leaves it and its state alone (AdamW's decay too), as on one process.
- Only optimizers whose update is elementwise per tensor
  (:data:`~gradhub.collective.sharded_optimizer.ELEMENTWISE`: SGD, Adam,
  AdamW, Adagrad, RMSprop, Adadelta, Adamax, NAdam, RAdam, ASGD, Rprop) are
  stepped on slices; any other (Adafactor, Muon, LBFGS, a subclass, another
  package's) is refused at ``prepare`` with
  :class:`~gradhub.errors.UnsupportedByStrategyError` naming
  ``strategy="allreduce"``, as are an optimizer that does not hold every
  trainable parameter (several optimizers) and trainable parameters of
  mixed dtypes.
- 16-bit parameters (all bf16 or all fp16): the model holds 16-bit copies,
  the slices' master weights and optimizer state are fp32 (as under mixed
  precision with master weights, not as torch's optimizer on bf16 tensors,
  which rounds every update to bf16); gradients are weighted and summed in
  fp32 and ``.grad`` holds the sum rounded once to the parameters' dtype.
  The state dict is fp32; a plain optimizer casts it on load.
- The script's optimizer is described by an :class:`~gradhub.optim.OptimizerSpec`;
  the slice optimizer has one group per group of the script's. Before every
  step the live hyperparameters of the script's groups (what an LR scheduler
  or the user set) are copied onto the slice optimizer's groups. The
  script's optimizer itself is never stepped; state it holds at ``prepare``
  (loaded before ``prepare``, nanoGPT's resume order) is moved into the
  slices, and it keeps none afterwards.
- ``optimizer.state_dict()`` is the full state in the single-process
  optimizer's format (same indices as the script's optimizer's, frozen
  parameters counted) and may be called on one rank alone: the other ranks'
  pieces come through their responder threads
  (:mod:`.sharded_state`), never a collective, within the group's
  timeout. A rank that is done (``close``, or the end of a script that
  never closes its model) answers on until every rank is done, bounded by
  the timeout, so rank 0's checkpoint after the last step gets every piece.
  Between a backward and its step it is refused (:class:`~gradhub.errors.MisuseError`):
  the other ranks may have stepped their slices; each answer carries its
  slice's step count, and counts that differ are an error, never a mixed state.
  ``load_state_dict`` (any time) and ``model.load_state_dict`` (after
  ``prepare``) take a plain optimizer's or model's state, of a job of any
  world size or strategy; each rank keeps its part, no communication.
- Parameters and buffers come from rank 0 at set-up; buffers follow DDP's
  ``broadcast_buffers`` at every forward (the common strategy machinery).
- Not supported: ``join()`` (uneven inputs) and ``register_comm_hook``:
  each says what to use instead at the call.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.distributed as dist

from gradhub import codecs
from gradhub._config import config_or_options
from gradhub.collective import AllReduceParameter, ShardedOptimizer, all_gather
from gradhub.collective.sharded_optimizer import check_elementwise
from gradhub.errors import UnsupportedByStrategyError
from gradhub.optim import OptimizerSpec
from gradhub.runtime import Runtime
from gradhub.train.strategies.base import Strategy
from gradhub.train.strategies.sharded_ahead import StepAhead
from gradhub.train.strategies.sharded_buckets import GradientBuckets, PieceGradients
from gradhub.train.strategies.sharded_config import ShardedConfig
from gradhub.train.strategies.sharded_state import (
    ShardResponder,
    assemble,
    check_groups,
    every_rank_pieces,
    load_pieces,
    per_parameter,
    plain_state_dict,
    stepped_pieces,
    to_bytes,
)
from gradhub.train.strategies.sharded_survival import ShardedSurvival
from gradhub.train.strategies.step_flags import StepFlags

_FLOATS = (str(torch.float32), str(torch.bfloat16), str(torch.float16))


class ShardedStrategy(ShardedSurvival, Strategy):
    """Reduce-scatter, all-gather of the gradient, owner-side step (ZeRO-1), all-gather."""

    name = "sharded"
    survives = True

    def __init__(self, config: ShardedConfig | None = None, **options: Any) -> None:
        super().__init__()
        self.config = config_or_options(ShardedConfig, config, options)
        self._groups: list[list[torch.nn.Parameter]] = []
        self._index: list[int] = []  # per parameter of the flat vector: its state-dict index
        self._flat = torch.zeros(0)
        self._grad = torch.zeros(0)  # fp32: the wire's (reduce-scatter input, all-gather output)
        self._model_grad = self._grad  # what .grad views: _grad itself, or a 16-bit copy
        self._grad_views: list[torch.Tensor] = []
        self._cuts: PieceGradients | None = None  # the pieces' gradients (_apply)
        self._arp: AllReduceParameter | None = None
        self._opt: ShardedOptimizer | None = None
        self._responder: ShardResponder | None = None
        self._buckets: GradientBuckets | None = None
        self._by_count = False
        self._flags: StepFlags | None = None
        self._ahead: StepAhead | None = None
        self._spec: OptimizerSpec | None = None
        self._sizes: list[list[int]] = []
        self._counted = False  # a surviving job counted the step when its slices stepped

    def setup(self, model: torch.nn.Module, optimizer: Any, runtime: Runtime) -> None:
        """Refuse what ``sharded`` cannot train as DDP would (typed errors naming
        ``allreduce``) before the common set-up."""
        if isinstance(optimizer, list | tuple):
            if len(optimizer) > 1:
                raise UnsupportedByStrategyError(
                    f"strategy 'sharded' shards one optimizer, got {len(optimizer)}\n- help: "
                    "one optimizer with a parameter group per setting, or "
                    'strategy="allreduce", which takes several optimizers'
                )
            optimizer = optimizer[0] if optimizer else None
        if isinstance(optimizer, torch.optim.Optimizer):
            self._check_supported(model, optimizer)
        super().setup(model, optimizer, runtime)

    def _setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        assert optimizer is not None
        spec = OptimizerSpec.of(optimizer)
        loaded = optimizer.state_dict() if optimizer.state else None
        trainable = {id(p) for p in self.params}
        numbering: dict[int, int] = {}  # torch's state-dict indices: every parameter, in order
        for g in optimizer.param_groups:
            for p in g["params"]:
                numbering.setdefault(id(p), len(numbering))
        self._groups = [
            [p for p in g["params"] if id(p) in trainable] for g in optimizer.param_groups
        ]
        self.params = [p for g in self._groups for p in g]  # the flat vector's order
        self._index = [numbering[id(p)] for p in self.params]
        self._broadcast_from_rank0(model)
        device = self.params[0].device
        size = sum(p.numel() for p in self.params)
        self._flat = torch.cat([p.detach().reshape(-1) for p in self.params]).to(device)
        self._grad = torch.zeros(size, dtype=torch.float32, device=device)
        sixteen = self._flat.dtype != torch.float32
        self._model_grad = torch.zeros_like(self._flat) if sixteen else self._grad
        offset = 0
        for p in self.params:  # parameters become views of the flat vector
            p.data = self._flat[offset : offset + p.numel()].view_as(p)
            self._grad_views.append(self._model_grad[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self._spec = spec
        self._sizes = [[p.numel() for p in g] for g in self._groups]
        self._every = [True] * len(self.params)
        self._check_survivable(self.config.compress)
        if self.runtime.joined is not None:  # a replacement: its slice from the survivors
            self._join_sharded()
            return
        self._build()
        self._mirror_slices(None)
        if loaded is not None:  # state loaded into the plain optimizer before prepare
            self._load_pieces(loaded)
            optimizer.state.clear()

    def _build(self) -> None:
        """The communication over the job's group (again after a regroup): the flat
        parameter, the slice optimizer, the buckets, the flags, the responder."""
        assert self._spec is not None
        device = self._flat.device
        sixteen = self._flat.dtype != torch.float32
        self._arp = AllReduceParameter(  # on the model's device (a mixed group's is the CPU)
            self._flat.numel(),
            group=self.runtime.group,
            compress=self.config.compress,
            device=device,
        )
        self._arp.init(self._flat if sixteen else list(self.params))
        if not sixteen:  # the parameters and gradients become views of the ARP's buffers
            self._bind()
        self._opt = ShardedOptimizer(self._arp, self._spec, param_sizes=self._sizes)
        self._buckets = GradientBuckets(
            self.params, self._grad, self._arp, self.runtime.group, self.config.bucket_mb
        )
        self._flags = StepFlags(len(self.params), self.runtime.group)
        wanted = self.config.step_ahead and self.config.overlap and not sixteen
        wanted = wanted and not self.runtime.survive  # a failed step must change nothing
        ahead = StepAhead.made(self._opt, self._arp, self.runtime, self.params, wanted)
        self._buckets.ahead = self._ahead = ahead
        if self.config.overlap:
            self._grad_ready = self._buckets.ready  # type: ignore[method-assign]
        self._start_responder()  # last: a request may come as soon as it runs

    def _bind(self) -> None:
        """fp32 parameters: views of the AllReduceParameter's flat weights, gradients
        of its flat gradients (shared memory where every rank is on one host). The
        step then publishes the master slice where it lies and the all-gathers
        read each rank's slice in place: no copy of the slice per step."""
        assert self._arp is not None
        had_grad = [p.grad is not None for p in self.params]
        self._arp.bind(self.params)
        self._flat, self._grad = self._arp.flat_weights, self._arp.flat_gradients
        self._model_grad = self._grad
        offsets = itertools.accumulate((p.numel() for p in self.params), initial=0)
        self._grad_views = [
            self._grad[o : o + p.numel()].view_as(p)
            for o, p in zip(offsets, self.params, strict=False)
        ]
        for p, had in zip(self.params, had_grad, strict=True):
            if not had:  # bind points every .grad at the buffer; keep None where it was
                p.grad = None

    def _check_supported(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        check_elementwise(optimizer, where="strategy 'sharded'")
        trainable = [p for p in model.parameters() if p.requires_grad]
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if any(id(p) not in held for p in trainable):
            raise UnsupportedByStrategyError(
                "strategy 'sharded' shards one optimizer over every trainable parameter; "
                "this one does not hold them all (several optimizers?)\n- help: build one "
                "optimizer over model.parameters() (parameter groups for different "
                'settings), or use strategy="allreduce", which takes several optimizers'
            )
        dtypes = sorted({str(p.dtype) for p in trainable})
        if len(dtypes) > 1 or (dtypes and dtypes[0] not in _FLOATS):
            raise UnsupportedByStrategyError(
                f"strategy 'sharded' keeps one flat vector of fp32, bf16 or fp16 parameters; "
                f"this model's trainable parameters are {', '.join(dtypes)}\n- help: give "
                "them one of those dtypes (e.g. model.float(), and torch.autocast for "
                '16-bit compute), or use strategy="allreduce"'
            )

    def _start_responder(self) -> None:
        """One responder per rank, under a key prefix agreed through rank 0's counter."""
        if self.world_size == 1:
            return
        rt = self.runtime
        raw = rt.store
        while isinstance(raw, dist.PrefixStore):
            raw = raw.underlying_store
        number = raw.add("gradhub/sharded/instances", 1) if rt.rank == 0 else 0
        group = rt.group
        rows = group.submit(
            "sharded set-up", lambda: group.all_gather_ints([number], "sharded set-up")
        ).wait()
        self._responder = ShardResponder(
            rt.store,
            f"gradhub/sharded/{rows[0][0]}/",
            rt.rank,
            rt.world_size,
            rt.timeout,
            self._serialised_pieces,
        )

    def _serialised_pieces(self) -> bytes:
        assert self._opt is not None
        return to_bytes(*stepped_pieces(self._opt, to_cpu=True))

    # one synchronising backward ------------------------------------------------------

    def _begin_sync(self) -> None:
        assert self._buckets is not None and self.optimizer is not None
        scale, self._by_count = self._weights()
        # Sums divided by a count known only after backward are gathered after it.
        self._buckets.begin(scale, gather=not self._by_count, live=self.optimizer.param_groups)

    def _grad_ready(self, p: torch.Tensor) -> None:
        """Nothing (``overlap=False``); else :meth:`_build` puts the buckets' own
        ``ready`` in its place (one call less per parameter and backward)."""

    def _finish_backward(self) -> None:
        """Complete the reduce-scatters, all-gather the sums, point ``.grad`` at them."""
        assert self._arp is not None and self._buckets is not None
        had = self._buckets.finish()  # None: every parameter had a gradient
        group = self.runtime.group
        # Per parameter: ranks that hold a gradient; last: the summed sample count.
        assert self._flags is not None
        count = self._samples[0] if self._by_count and self._samples else 0
        self._flags.write(self._every if had is None else had, count, self._joining())
        counted = self._flags.launch()  # queued behind the reduce-scatters
        reduced = self._arp.aggregate_gradient_partition()
        used, total = self._flags.read(None if counted is None else counted.wait)
        self._regroup_after = self.runtime.survive and self._flags.regroup()
        if not self._buckets.wait_gathered():
            if self._by_count:
                reduced.div_(total)
            all_gather(
                reduced,
                self._arp.size,
                group=group,
                compress=self._arp.gradient_codec,
                out=self._grad,
            )
        if self._model_grad is not self._grad:
            self._model_grad.copy_(self._grad)  # rounded once, the same on every rank
        every = bool(used.all())
        for p, view, anywhere in zip(self.params, self._grad_views, used, strict=True):
            if every or (anywhere and p.grad is not view):
                p.grad = view  # (where every one was used: cheaper than reading it first)
        self._buckets.backward_done(every)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch's clip over ``model.parameters()`` (its order: the same bits as
        the script's own ``torch.nn.utils.clip_grad_norm_`` line)."""
        assert self.model is not None
        return torch.nn.utils.clip_grad_norm_(
            list(self.model.parameters()), max_norm, norm_type=norm_type
        )

    def use_loss_scaling(self) -> None:
        assert self._arp is not None
        if isinstance(self._arp.gradient_codec, codecs.FP16):
            self._arp.gradient_codec = codecs.FP16(saturate=False)

    def _apply(self) -> None:
        assert self._arp is not None and self._opt is not None and self.optimizer is not None
        for mine, live in zip(self._opt.param_groups, self.optimizer.param_groups, strict=True):
            mine.update({k: v for k, v in live.items() if k != "params"})
        if self._ahead is not None and self._ahead.keep(self.optimizer.param_groups):
            self._flat = self._ahead.weights  # stepped during the backward: sharded_ahead
            return
        cut = self._cuts
        if cut is None or cut.pieces is not self._opt.pieces or cut.views is not self._grad_views:
            combined = self._model_grad is self._grad
            cut = PieceGradients(self.params, self._opt.pieces, self._grad_views, combined)
            self._cuts = cut
        cut.step(self._opt, keep=self._ahead is None)
        self._step_mirrors()  # survival: the slices this rank holds for others
        if self._ahead:
            self._ahead.gather().wait()
        elif not self._arp.holds_all_weights(self._flat):
            self._arp.get_weights(self._flat).wait()

    def _count_step(self) -> None:
        super()._step_done()
        self._counted = True  # the step's _step_done, after the weights' gather, is this one

    def _step_done(self) -> None:
        if self._counted:
            self._counted = False
            return
        super()._step_done()

    def _apply_unsynced(self) -> None:
        """``step`` with no backward since the last one: as DDP, on what ``.grad``
        holds (the combined gradient, the same bits on every rank, or None)."""
        self._apply()
        self._step_done()

    # the full optimizer state ------------------------------------------------------

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The whole state in the plain optimizer's format; on one rank alone too."""
        assert self._opt is not None and self.optimizer is not None
        pieces = every_rank_pieces(self._opt, self._responder, between=self._synced)
        whole = assemble(pieces, [p.shape for p in self.params], self._flat.device)
        state = {self._index[j]: s for j, s in whole.items()}
        return plain_state_dict(state, self.optimizer.param_groups)

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None
        check_groups(state, self.optimizer.param_groups)
        for saved, live in zip(state["param_groups"], self.optimizer.param_groups, strict=True):
            live.update({k: v for k, v in saved.items() if k != "params"})
        self._load_pieces(state)

    def _load_pieces(self, state: dict[str, Any]) -> None:
        assert self._opt is not None and self.optimizer is not None
        states = per_parameter(state, self.optimizer.param_groups, self.params)
        load_pieces(self._opt, states)
        for mirror in self._mirrors:  # a surviving job's copies of other ranks' slices
            load_pieces(mirror, states)  # type: ignore[arg-type]  # the same fields

    def model_loaded(self) -> None:
        """The model's (loaded) values become this rank's master slice."""
        assert self._arp is not None
        start, length = self._arp.local_partition_range
        with torch.no_grad():
            self._arp.weight_partition.copy_(self._flat[start : start + length])
            for mirror in self._mirrors:
                mirror.weights.copy_(self._flat[mirror.start : mirror.start + mirror.length])
        self._arp.send_weight_partition()

    def close(self) -> None:
        if self._responder is not None:
            self._responder.close()
        if self._arp is not None:
            self._arp.close()
        super().close()
