"""``sharded`` in a surviving job (``gradhub run --survive``): no slice of the
optimizer state dies with its rank.

- **Every slice on two ranks.** Besides its own slice, each rank holds a
  mirror of another rank's (:class:`Mirror`): that slice's fp32 master
  weights and optimizer state, stepped at every step with the same combined
  gradient the owner steps it with (``.grad`` holds the same bits on every
  rank), so owner and mirror stay bit-identical without sending any state.
  The mirror of slice ``i`` is on another host's rank where there is one
  (the next rank where all share one host; the k-th rank of a host on the
  k-th of the ranks after it elsewhere, so that each rank holds one mirror
  where the hosts hold as many ranks each): the death of a whole host loses
  no slice while another host lives. Cost per step: one
  more slice's optimizer step (``1/P`` of the model's elementwise update)
  and, per rank, one more slice of fp32 weights and optimizer state.
- **A step commits on every survivor or on none.** A rank counts a step as
  applied once it stepped its slices (before the weights' all-gather). A
  peer may die while the step's gradient reaches only some ranks: those
  that got it stepped, the others did not. After the regroup the lowest
  rank that stepped broadcasts the step's combined gradient (still in its
  flat gradient buffer: no backward ran since), and the ranks behind step
  their slices with it: the step is then applied everywhere, never trained
  again. Where no survivor stepped, none did, and the batch is trained again.
- **Re-partitioned over the survivors.** Each survivor sends the slices it
  holds (its own; a mirror whose owner died) to every survivor, which
  assembles the whole master weights and optimizer state and sets the
  flat parameter, the slice optimizer and the mirrors up again over the new
  group: every slice at its new owner and its new mirror. A replacement
  takes its slice the same way, holding none. Cost per change: the whole
  optimizer state and weights once to every survivor (a regroup is rare).
  Both holders of a slice dead in one change: :class:`~gradhub.errors.StateLostError`.
- Under survival ``sharded`` keeps fp32 parameters and no wire codec (the
  masters are the parameters themselves): other settings are refused at
  ``prepare``. Its bucket-wise step during the backward
  (:mod:`.sharded_ahead`) is off: every step steps at ``step()``, where the
  mirrors step too.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradhub._shm.hosts import host_identity
from gradhub.collective.sharded_optimizer import Piece, _pieces
from gradhub.errors import StateLostError, UnsupportedByStrategyError
from gradhub.optim import OptimizerSpec
from gradhub.partition import partition_ranges
from gradhub.train.strategies.sharded_state import PieceState, assemble, load_pieces, pieces_state

if TYPE_CHECKING:
    from gradhub.collective import AllReduceParameter, ShardedOptimizer
    from gradhub.runtime import Runtime
    from gradhub.runtime.membership import Regrouped
    from gradhub.train.strategies.sharded_state import ShardResponder

Held = tuple[int, torch.Tensor, list[PieceState]]
"""A slice a rank holds: its start in the flat vector, its master weights, its state."""


class Mirror:
    """Another rank's slice, held here too: its fp32 master weights and its
    optimizer state, stepped with the same gradient as the owner steps it."""

    def __init__(
        self,
        spec: OptimizerSpec,
        param_sizes: list[list[int]],
        start: int,
        length: int,
        flat: torch.Tensor,
    ) -> None:
        self.start, self.length = start, length
        self.weights = flat[start : start + length].detach().float().clone()
        self.pieces: list[Piece] = _pieces(param_sizes, start, length, self.weights)
        grouped: list[list[torch.Tensor]] = [[] for _ in param_sizes]
        for piece in self.pieces:
            grouped[piece.group].append(piece.view)
        self.optimizer = spec.build(grouped)
        self.lock = threading.Lock()

    def step(self, grads: Sequence[torch.Tensor | None], live: list[dict[str, Any]]) -> None:
        """Step the pieces with ``grads`` (per piece; None: not stepped) under the
        script's live hyperparameters (an LR schedule), as the owner does."""
        for mine, group in zip(self.optimizer.param_groups, live, strict=True):
            mine.update({k: v for k, v in group.items() if k != "params"})
        for piece, grad in zip(self.pieces, grads, strict=True):
            piece.view.grad = grad
        try:
            with self.lock:
                self.optimizer.step()
        finally:
            for piece in self.pieces:
                piece.view.grad = None


def piece_grads(
    pieces: Sequence[Piece], grads: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Per piece, its part of its parameter's gradient (``grads`` per parameter)."""
    out: list[torch.Tensor | None] = []
    for piece in pieces:
        grad = grads[piece.index]
        if grad is not None:
            flat = grad.detach().reshape(-1)
            grad = flat[piece.offset : piece.offset + piece.view.numel()].float()
        out.append(grad)
    return out


class ShardedSurvival:
    """The survival part of :class:`~gradhub.train.strategies.sharded.ShardedStrategy`."""

    params: list[torch.nn.Parameter]
    model: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None
    steps: int
    _flat: torch.Tensor
    _grad: torch.Tensor
    _arp: AllReduceParameter | None
    _opt: ShardedOptimizer | None
    _responder: ShardResponder | None
    _spec: OptimizerSpec | None
    _sizes: list[list[int]]
    _counted: bool
    failed_steps: int
    _mirrors: Sequence[Mirror] = ()
    _holders: Mapping[int, tuple[int, int]] = MappingProxyType({})
    """Per slice start: its owner and its mirror's rank (the current group's)."""
    _applied: list[bool] | None = None
    """Which parameters the last step applied a gradient to (until the next step)."""
    _whole: tuple[torch.Tensor, dict[int, dict[str, Any]]] | None = None
    """The whole master weights and state, assembled in a regroup that has not ended."""

    runtime: Runtime
    _build: Callable[[], None]
    _count_step: Callable[[], None]
    """Count the step as applied (the strategy's step bookkeeping)."""
    _step_done: Callable[[], None]
    _wait: Callable[[Any, str], None]

    def _check_survivable(self, compress: str) -> None:
        """At set-up of a surviving job: what the mirrors cannot keep is refused."""
        if not self.runtime.survive:
            return
        dtypes = {p.dtype for p in self.params}
        if compress != "none" or dtypes != {torch.float32}:
            raise UnsupportedByStrategyError(
                "strategy 'sharded' survives a worker's death with fp32 parameters and no "
                f"wire codec (got compress={compress!r}, parameters {sorted(map(str, dtypes))})"
                "\n- help: drop compress= and keep the parameters fp32 (torch.autocast for "
                "16-bit compute), or drop --survive"
            )

    # every step ------------------------------------------------------------------

    def _step_mirrors(self) -> None:
        """Right after this rank stepped its own slice: step the mirrors; in a
        surviving job the step counts as applied here (see the module docstring)."""
        if not self.runtime.survive:
            return
        assert self.optimizer is not None
        grads = [p.grad for p in self.params]
        for mirror in self._mirrors:
            mirror.step(piece_grads(mirror.pieces, grads), self.optimizer.param_groups)
        self._applied = [g is not None for g in grads]
        self._count_step()

    def _mirror_slices(self, states: dict[int, dict[str, Any] | None] | None) -> None:
        """Choose every slice's mirror (another host's rank where there is one)
        and set up the ones this rank holds, with ``states`` (per parameter)."""
        self._mirrors, self._holders = (), MappingProxyType({})
        rt = self.runtime
        if not rt.survive or rt.world_size == 1:
            return
        assert self._spec is not None
        hosts = [h.decode() for h in self._all_gather_bytes(host_identity().encode())]
        n = rt.world_size
        mirrors: list[Mirror] = []
        holders: dict[int, tuple[int, int]] = {}
        for i, (start, length) in enumerate(partition_ranges(self._flat.numel(), n)):
            others = [(i + d) % n for d in range(1, n)]
            away = [r for r in others if hosts[r] != hosts[i]] or others[:1]
            # The k-th rank of a host mirrors on the k-th rank after it elsewhere:
            # one mirror per rank where the hosts hold as many ranks each.
            holder = away[hosts[:i].count(hosts[i]) % len(away)]
            holders[start] = (i, holder)
            if holder == rt.rank and length:
                mirror = Mirror(self._spec, self._sizes, start, length, self._flat)
                if states:
                    load_pieces(mirror, states)  # type: ignore[arg-type]  # same fields
                mirrors.append(mirror)
        self._mirrors, self._holders = tuple(mirrors), MappingProxyType(holders)

    # a membership change ---------------------------------------------------------

    def _regrouped(self, done: Regrouped) -> None:
        """After the runtime's regroup: finish a step some survivors applied, then
        set the slices up again over the survivors."""
        self._roll_forward(done)
        self._repartition(done)
        self._counted = False  # a step counted when its slices stepped: no gather follows

    def _set_up_joined(self) -> None:
        """A replacement took its slice in ``_setup`` (:meth:`_join_sharded`)."""
        return

    def _join_sharded(self) -> None:
        """At set-up of a replacement: take part in the survivors' regroup."""
        done = self.runtime.joined
        assert done is not None
        self.runtime.joined = None
        self._roll_forward(done)
        self._repartition(done)

    def _roll_forward(self, done: Regrouped) -> None:
        best = done.committed_steps
        if best == 0 or not any(n == best - 1 for n in done.steps):
            return
        rank = self.runtime.rank
        source = rank == done.source
        flat = self._grad if source else torch.empty(self._flat.numel(), dtype=torch.float32)
        mask = torch.zeros(len(self.params), dtype=torch.uint8)
        if source and self._applied is not None:
            mask = torch.tensor(self._applied, dtype=torch.uint8)
        self._broadcast_from(done.source, [flat, mask])
        if self._opt is None:
            return  # a replacement: it holds no slice
        self.failed_steps -= 1  # finished here, not trained again
        if self.runtime.committed_steps != best - 1:
            return  # already applied here
        assert self.optimizer is not None
        grads: list[torch.Tensor | None] = []
        offset = 0
        for p, used in zip(self.params, mask.tolist(), strict=True):
            grads.append(flat[offset : offset + p.numel()] if used else None)
            offset += p.numel()
        self._opt.step_pieces(piece_grads(self._opt.pieces, grads))
        for mirror in self._mirrors:
            mirror.step(piece_grads(mirror.pieces, grads), self.optimizer.param_groups)
        self._step_done()

    def _repartition(self, done: Regrouped) -> None:
        rank = self.runtime.rank
        extra: dict[str, Any] = {"holders": dict(self._holders)}
        if rank == done.source:
            assert self.model is not None
            extra["buffers"] = [b.detach().cpu() for b in self.model.buffers()]
            extra["steps"] = self.steps
        buffer = io.BytesIO()
        torch.save((self._held(), extra), buffer)
        gathered = [
            torch.load(io.BytesIO(b), weights_only=False)
            for b in self._all_gather_bytes(buffer.getvalue())
        ]
        master, whole = self._assemble([held for held, _ in gathered], gathered)
        self._whole = (master, whole)  # until the set-up below ends (another death?)
        ahead = gathered[done.source][1]
        if rank in done.behind and self.model is not None and "buffers" in ahead:
            with torch.no_grad():
                for b, value in zip(self.model.buffers(), ahead["buffers"], strict=True):
                    b.copy_(value)
        self.steps = max(self.steps, int(ahead.get("steps", self.steps)))
        self.runtime.committed_steps = done.committed_steps
        if self._responder is not None:
            self._responder.drop()
            self._responder = None
        if self._arp is not None:
            self._arp.close()
        with torch.no_grad():
            offset = 0
            for p in self.params:
                p.data.copy_(master[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        self._build()
        assert self._opt is not None
        states: dict[int, dict[str, Any] | None] = {**whole}
        load_pieces(self._opt, states)
        self._mirror_slices(states)
        self._whole = None

    def _held(self) -> list[Held]:
        """The slices this rank holds (all of them while a regroup is unfinished)."""
        if self._whole is not None:
            master, whole = self._whole
            pieces = [(index, 0, state) for index, state in whole.items()]
            return [(0, master, pieces)]
        if self._opt is None or self._arp is None:
            return []  # a replacement
        start, _ = self._arp.local_partition_range
        out = [(start, self._arp.weight_partition.detach().cpu().clone(), self._pieces(self._opt))]
        for mirror in self._mirrors:
            out.append((mirror.start, mirror.weights.clone(), self._pieces(mirror)))
        return out

    @staticmethod
    def _pieces(holder: ShardedOptimizer | Mirror) -> list[PieceState]:
        return pieces_state(holder, to_cpu=True)  # type: ignore[arg-type]  # same fields

    def _assemble(
        self, helds: list[list[Held]], gathered: list[tuple[list[Held], dict[str, Any]]]
    ) -> tuple[torch.Tensor, dict[int, dict[str, Any]]]:
        size = self._flat.numel()
        master = torch.empty(size, dtype=torch.float32)
        pieces: list[PieceState] = []
        covered: list[tuple[int, int]] = []
        # Largest first: a whole (from an unfinished regroup) makes every slice redundant.
        for start, weights, states in sorted(
            (h for held in helds for h in held), key=lambda h: -h[1].numel()
        ):
            end = start + weights.numel()
            if weights.numel() == 0 or any(a <= start and end <= b for a, b in covered):
                continue  # the same slice from its other holder: the same bits
            master[start:end] = weights
            pieces.extend(states)
            covered.append((start, end))
        covered.sort()
        reached = 0
        for start, end in covered:
            if start > reached:
                break
            reached = max(reached, end)
        if reached < size:
            holders: dict[int, Any] = next((e["holders"] for _, e in gathered if e["holders"]), {})
            owner, mirror = holders.get(reached, ("?", "?"))
            raise StateLostError(
                f"the optimizer state of elements {reached}.. of the flattened parameters "
                f"was held by ranks {owner} (its owner) and {mirror} (its mirror) of the "
                "previous group, and both died\n- help: restart the job from its last "
                "checkpoint (gradhub run --max-restarts without --survive resumes it)"
            )
        return master, assemble(pieces, [p.shape for p in self.params], self._flat.device)

    # communication over the new group (failures name the rank, as in a step) -----------

    def _broadcast_from(self, src: int, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            self._wait(dist.broadcast(t, src=src, async_op=True), f"broadcast from rank {src}")

    def _all_gather_bytes(self, payload: bytes) -> list[bytes]:
        n = self.runtime.world_size
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        mine = torch.tensor([data.numel()], dtype=torch.int64)
        self._wait(dist.all_gather(sizes, mine, async_op=True), "all-gather of sizes")
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: data.numel()] = data
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
        self._wait(dist.all_gather(out, padded, async_op=True), "all-gather of state")
        return [o[: int(s.item())].numpy().tobytes() for o, s in zip(out, sizes, strict=True)]
