"""ShardedOptimizer: a ``torch.optim`` optimizer over the owned slice (ZeRO-1).

Each rank's optimizer sees only its ``AllReduceParameter.weight_partition``,
so optimizer state (momentum, Adam's moments) exists for that slice only and
is spread over the ranks instead of copied on each.

.. code-block:: python

    opt = ShardedOptimizer(p, lambda params: torch.optim.Adam(params, lr=1e-3))
    p.put_gradients(grads)
    opt.step(avg_numbers=global_batch_size)   # aggregate, step, publish
    p.get_weights(weights).wait()

Three ways to cut the slice into the slice optimizer's parameters:

- a factory: one tensor, the whole slice (BigDL's flat slice). The factory's
  optimizer sees a flat vector, so only an optimizer whose update is
  elementwise gives the result it would give on the model's tensors.
- an :class:`~gradhub.optim.OptimizerSpec` and ``group_sizes`` (how many
  elements of the flat vector each of the spec's groups covers, back to
  back): the slice is cut where it crosses group boundaries and each piece
  (possibly empty) is one parameter group with that group's hyperparameters.
  ``views[g]`` and ``ranges[g]`` (start, end in the flat vector) say which
  part of group ``g`` this rank owns.
- a spec and ``param_sizes`` (per group, the element count of each of its
  parameters): every parameter's part of the slice is a parameter of its own
  (a :class:`Piece`), in its group. :meth:`step_pieces` gives each piece its
  gradient, ``None`` for a parameter no rank used, so torch's optimizer
  leaves that piece and its state untouched (its weight decay and momentum
  included), and each piece keeps its own per-parameter state (Adam's
  ``step``), as the single-process optimizer keeps it per tensor.

With a spec, the optimizer must be one whose update is elementwise per tensor
(:data:`ELEMENTWISE`): on a slice of a tensor it computes what it computes on
that part of the whole tensor. Any other (Adafactor's factored moments,
Muon's orthogonalisation, LBFGS's line search, a class outside ``torch.optim``)
is refused with :class:`~gradhub.errors.UnsupportedByStrategyError`.

Decisions: ``step`` does aggregate -> optimizer step -> ``send_weight_partition``,
the three calls every caller would otherwise repeat. A gradient is set as
a piece's ``.grad`` for the step only and cleared after, so no stale
gradient survives. An empty slice (``size < world size``) is stepped like
any other (torch optimizers accept empty tensors and empty groups).
:attr:`lock` is held while the optimizer steps or its state is loaded, so a
reader holding it (the ``sharded`` strategy's state responder) never sees
a state half-way through a step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradhub.collective.allreduce_parameter import AllReduceParameter
from gradhub.errors import (
    InvalidOptionError,
    StateError,
    UnsupportedByStrategyError,
    WrongTypeError,
)
from gradhub.optim import OptimizerFactory, OptimizerSpec

ELEMENTWISE = frozenset(
    {"SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta", "Adamax", "NAdam", "RAdam"}
    | {"ASGD", "Rprop"}
)
"""``torch.optim`` classes whose update of an element depends on that element's
gradient and state, the step count and the hyperparameters only (each one's
``step`` read for it): stepping a slice of a tensor gives that part of the
whole tensor's step. Not in it: ``Adafactor`` (row and column moments),
``Muon`` (orthogonalises the whole matrix), ``LBFGS`` (a line search over
every parameter), ``SparseAdam`` (sparse gradients only)."""


def check_elementwise(optimizer: torch.optim.Optimizer | type | str, *, where: str) -> None:
    """Raise :class:`UnsupportedByStrategyError` unless ``optimizer`` (an
    instance, class or ``torch.optim`` class name) is in :data:`ELEMENTWISE`."""
    if isinstance(optimizer, str):
        cls: Any = getattr(torch.optim, optimizer, None)
        name = optimizer
    else:
        cls = optimizer if isinstance(optimizer, type) else type(optimizer)
        name = f"{cls.__module__}.{cls.__qualname__}"
    known = (
        isinstance(cls, type)
        and cls.__name__ in ELEMENTWISE
        and getattr(torch.optim, cls.__name__, None) is cls
    )
    if not known:
        raise UnsupportedByStrategyError(
            f"{where} steps the optimizer on slices of the flattened parameters, which is "
            f"right only for an update that is elementwise per tensor; {name} is not known "
            f"to be (known: {', '.join(sorted(ELEMENTWISE))})\n"
            '- help: use strategy="allreduce", which steps your own optimizer on whole '
            "tensors (any optimizer object)"
        )


@dataclass(frozen=True)
class Piece:
    """One parameter's part of this rank's slice (``param_sizes`` mode)."""

    group: int
    """The spec group (the script's parameter group) it belongs to."""
    index: int
    """The parameter's position among all of ``param_sizes``, group after group."""
    offset: int
    """Where the piece starts inside the parameter (flattened)."""
    start: int
    """Where the piece starts inside this rank's slice."""
    view: torch.Tensor
    """The piece of ``weight_partition``: the slice optimizer's parameter."""


class ShardedOptimizer:
    """Steps ``parameter.weight_partition`` with the optimizer ``optimizer`` describes.

    ``optimizer``: a factory that receives ``[weight_partition]`` and returns any
    ``torch.optim.Optimizer`` (one group), or an ``OptimizerSpec`` with
    ``group_sizes`` or ``param_sizes`` (one group per spec group; see the
    module docstring). ``parameter`` must be initialised (``init``).
    """

    def __init__(
        self,
        parameter: AllReduceParameter,
        optimizer: OptimizerFactory | OptimizerSpec,
        *,
        group_sizes: Sequence[int] | None = None,
        param_sizes: Sequence[Sequence[int]] | None = None,
    ):
        if not parameter.initialized:
            raise StateError(
                f"[rank {parameter.partition_id}] ShardedOptimizer needs an initialised "
                "AllReduceParameter; call parameter.init(weights) first"
            )
        if param_sizes is not None:
            if group_sizes is not None:
                raise InvalidOptionError("give group_sizes or param_sizes, not both")
            if not isinstance(optimizer, OptimizerSpec):
                raise InvalidOptionError("param_sizes needs an OptimizerSpec, not a factory")
            group_sizes = [sum(g) for g in param_sizes]
        self.parameter = parameter
        self.lock = threading.Lock()
        """Held while the optimizer steps or loads state."""
        self.steps = 0
        """Steps the slice took, counted under :attr:`lock` with the state they made."""
        start, length = parameter.local_partition_range
        weights = parameter.weight_partition
        sizes = list(group_sizes) if group_sizes is not None else [parameter.size]
        if sum(sizes) != parameter.size or any(s < 0 for s in sizes):
            raise InvalidOptionError(
                f"group_sizes {sizes} must add up to the size {parameter.size}"
            )
        self.ranges: list[tuple[int, int]] = []
        self.views: list[torch.Tensor] = []
        self._cuts: list[tuple[int, int]] = []  # per group: [a, b) within the slice
        offset = 0
        for size in sizes:
            a = min(max(offset, start), start + length) - start
            b = min(max(offset + size, start), start + length) - start
            self.ranges.append((offset, offset + size))
            self._cuts.append((a, b))
            self.views.append(weights[a:b] if len(sizes) > 1 else weights)
            offset += size
        self.pieces: list[Piece] = []
        """Per parameter that overlaps this slice, its piece (``param_sizes`` only)."""
        if param_sizes is not None:
            self.pieces = _pieces(param_sizes, start, length, weights)
        if isinstance(optimizer, OptimizerSpec):
            check_elementwise(optimizer.name, where="ShardedOptimizer")
            if param_sizes is not None:
                grouped: list[list[torch.Tensor]] = [[] for _ in sizes]
                for piece in self.pieces:
                    grouped[piece.group].append(piece.view)
                self.optimizer = optimizer.build(grouped)
            else:
                self.optimizer = optimizer.build([[v] for v in self.views])
        else:
            if group_sizes is not None and len(sizes) > 1:
                raise InvalidOptionError("several groups need an OptimizerSpec, not a factory")
            self.optimizer = optimizer([weights])
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise WrongTypeError(
                f"the factory must return a torch.optim.Optimizer, got {type(self.optimizer)!r}"
            )

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's parameter groups (for learning-rate schedules)."""
        return self.optimizer.param_groups

    def owned(self, group: int) -> tuple[int, int]:
        """The part of group ``group`` this rank owns, as offsets into that group."""
        a, b = self._cuts[group]
        start = self.parameter.local_partition_range[0]
        first = self.ranges[group][0]
        return start + a - first, start + b - first

    def step(self, avg_numbers: float = 1) -> torch.Tensor:
        """Aggregate the gradients put with ``put_gradients`` (divided by
        ``avg_numbers``), step the optimizer on the owned slice and publish it.

        Returns the updated ``weight_partition``.
        """
        return self.apply(self.parameter.aggregate_gradient_partition(avg_numbers))

    def apply(self, gradient: torch.Tensor) -> torch.Tensor:
        """Step with ``gradient`` (this slice's, already aggregated) and publish."""
        if self.pieces:
            return self.step_pieces([gradient[p.start : self._end(p)] for p in self.pieces])
        for view, (a, b) in zip(self.views, self._cuts, strict=True):
            view.grad = gradient[a:b] if len(self.views) > 1 else gradient
        return self._step_and_publish(self.views)

    def step_pieces(self, gradients: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Step with one gradient per piece (``None``: the piece and its state stay
        as they are) and publish; ``param_sizes`` mode."""
        if len(gradients) != len(self.pieces):
            raise InvalidOptionError(f"{len(gradients)} gradients for {len(self.pieces)} pieces")
        for piece, grad in zip(self.pieces, gradients, strict=True):
            piece.view.grad = grad
        return self._step_and_publish([p.view for p in self.pieces])

    def _step_and_publish(self, stepped: list[torch.Tensor]) -> torch.Tensor:
        try:
            with self.lock:
                self.optimizer.step()
                self.steps += 1
        finally:
            for view in stepped:
                view.grad = None
        self.parameter.send_weight_partition()
        return self.parameter.weight_partition

    def _end(self, piece: Piece) -> int:
        return piece.start + piece.view.numel()

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state."""
        with self.lock:
            return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.optimizer.load_state_dict(state)


def _pieces(
    param_sizes: Sequence[Sequence[int]], start: int, length: int, weights: torch.Tensor
) -> list[Piece]:
    pieces: list[Piece] = []
    offset = index = 0
    for group, sizes in enumerate(param_sizes):
        for n in sizes:
            a, b = max(offset, start), min(offset + n, start + length)
            if b > a:
                pieces.append(
                    Piece(group, index, a - offset, a - start, weights[a - start : b - start])
                )
            offset += n
            index += 1
    return pieces
