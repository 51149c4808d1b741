"""What the calling rank can see is wrong with an operation's arguments.

Every operation of :class:`~gradhub.backend.process_group.GradhubProcessGroup`
checks its arguments here, on the calling thread, before it is queued. A
failed check raises :class:`~gradhub.errors.CollectiveArgumentError` from the
operation call itself: nothing is sent, the operation is not numbered, and
the group stays usable (only a dead peer or a timeout breaks a group; see
:class:`~gradhub.transports.group.CollectiveGroup`).

What is refused is what gloo refuses for the same call on CPU (checked on
torch 2.13): a dtype other than gloo's (:data:`GLOO_DTYPES`), ``AVG`` of
integers or booleans, ``BAND``/``BOR``/``BXOR`` of floating-point tensors,
``PREMUL_SUM`` of integers, lists of the wrong length, tensors whose dtypes
or shapes do not fit together, a root rank outside the group, split sizes
that do not add up. gloo raises some of these from ``wait()`` after the
exchange; here each is raised before it, a ``RuntimeError`` as gloo's (what
DDP and torch's own code catch), never a failed ``Work`` (failing a Work's
future crashes DDP's backward). What only another
rank could see (a peer that passes other sizes) cannot be checked here: the
operation then runs into the group's timeout, as on gloo.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gradhub.backend.operations import RedOp, Reduction
from gradhub.errors import CollectiveArgumentError

GLOO_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)
"""The dtypes gloo's collectives take on CPU (any other: "Invalid scalar type")."""

_BITWISE = (RedOp.BAND, RedOp.BOR, RedOp.BXOR)


def _shape(t: torch.Tensor) -> list[int]:
    return list(t.shape)


@dataclass(frozen=True)
class Call:
    """One operation call being checked: its name, and the group's rank and size."""

    name: str
    rank: int
    size: int

    def refuse(self, what: str, help: str) -> CollectiveArgumentError:
        return CollectiveArgumentError(f"[rank {self.rank}] {self.name}: {what}\n- help: {help}")

    def tensors(self, tensors: Sequence[torch.Tensor], *, empty: bool = False) -> None:
        """CPU tensors of dtypes gloo takes; at least one unless ``empty``."""
        if not tensors and not empty:
            raise self.refuse("got no tensor", "pass the tensor(s) the operation works on")
        for t in tensors:
            if not t.is_cpu:
                raise self.refuse(
                    f"the gradhub backend takes CPU tensors, got one on {t.device}",
                    'use NCCL for GPU tensors: dist.init_process_group("nccl")',
                )
            if t.dtype not in GLOO_DTYPES:
                names = ", ".join(sorted(str(d).removeprefix("torch.") for d in GLOO_DTYPES))
                raise self.refuse(
                    f"{t.dtype} tensors are not supported (gloo: Invalid scalar type)",
                    f"convert to one of {names}",
                )

    def reduction(self, tensors: Sequence[torch.Tensor], red: Reduction) -> None:
        """``red`` has a meaning for the tensors' dtype."""
        if red.is_sum:  # any dtype gloo takes
            return
        for t in tensors:
            floating = t.is_floating_point()
            if red.is_average and not floating:
                raise self.refuse(
                    f"ReduceOp.AVG needs floating-point tensors, got {t.dtype} (gloo: result "
                    "type Float can't be cast to the desired output type)",
                    "reduce with ReduceOp.SUM and divide, or reduce a floating-point copy",
                )
            if red.is_premul and not floating:
                raise self.refuse(
                    f"ReduceOp.PREMUL_SUM needs floating-point tensors, got {t.dtype}",
                    "multiply the integers yourself and use ReduceOp.SUM",
                )
            if red.kind in _BITWISE and floating:
                raise self.refuse(
                    f"ReduceOp.{red.kind.name} needs integer or bool tensors, got {t.dtype} "
                    "(gloo: non-integral dtype)",
                    "use SUM, AVG, MAX, MIN or PRODUCT for floating-point tensors",
                )

    def alike(self, tensors: Sequence[torch.Tensor], like: torch.Tensor, what: str) -> None:
        """Every tensor of ``tensors`` (``what`` 0, 1, ...) has ``like``'s dtype and shape."""
        for i, t in enumerate(tensors):
            self.fits(t, like, f"{what} {i}")

    def fits(self, tensor: torch.Tensor, like: torch.Tensor, what: str) -> None:
        """``tensor`` (``what``) has ``like``'s dtype and shape."""
        if tensor.dtype != like.dtype or tensor.shape != like.shape:
            raise self.refuse(
                f"{what} is {tensor.dtype} of shape {_shape(tensor)}; expected "
                f"{like.dtype} of shape {_shape(like)}",
                "give every tensor of the call the dtype and shape the operation expects",
            )

    def same_dtype(self, tensors: Sequence[torch.Tensor]) -> None:
        dtypes = sorted({str(t.dtype) for t in tensors})
        if len(dtypes) > 1:
            raise self.refuse(
                f"the tensors have different dtypes: {', '.join(dtypes)}",
                "convert them to one dtype first",
            )

    def count(self, items: Sequence[object], expected: int, what: str) -> None:
        if len(items) != expected:
            raise self.refuse(
                f"{what} has {len(items)} entries; expected {expected}",
                f"pass {expected} (the group has {self.size} rank(s))",
            )

    def root(self, root: int, tensors: int | None = None, root_tensor: int = 0) -> None:
        """``root`` is a rank of the group (and ``root_tensor`` an index of ``tensors``)."""
        if not 0 <= root < self.size:
            raise self.refuse(
                f"root rank {root} is not a rank of this group of {self.size}",
                f"pass a group rank in 0..{self.size - 1} (dist.get_group_rank "
                "turns a global rank into one)",
            )
        if tensors is not None and not 0 <= root_tensor < tensors:
            raise self.refuse(
                f"root tensor {root_tensor} is not an index of the {tensors} tensor(s)",
                f"pass an index in 0..{tensors - 1}",
            )

    def concatenated(self, whole: torch.Tensor, part: torch.Tensor, what: str) -> None:
        """``whole`` is ``size`` of ``part`` back to back along dim 0, of its dtype
        (gloo's rule for all_gather_into_tensor and reduce_scatter_tensor)."""
        rows, rest = (part.shape[0], _shape(part)[1:]) if part.dim() else (1, [])
        expected = [rows * self.size, *rest]
        if whole.dtype != part.dtype or _shape(whole) != expected:
            raise self.refuse(
                f"{what} is {whole.dtype} of shape {_shape(whole)}; expected {part.dtype} of "
                f"shape {expected} ({self.size} of {_shape(part)} along dim 0)",
                "make the larger tensor the group size times the smaller one along dim 0",
            )

    def splits(self, splits: Sequence[int], tensor: torch.Tensor, what: str) -> None:
        """All-to-all split sizes of ``tensor`` (none: equal parts)."""
        rows = tensor.shape[0] if tensor.dim() else 1
        if not splits:
            if rows % self.size:
                raise self.refuse(
                    f"{what} has {rows} rows, which do not divide among {self.size} ranks",
                    "pass split sizes, or a tensor whose dim 0 divides by the group size",
                )
            return
        if len(splits) != self.size or any(s < 0 for s in splits) or sum(splits) != rows:
            raise self.refuse(
                f"split sizes {list(splits)} of {what} do not split its {rows} rows "
                f"among {self.size} ranks",
                f"pass {self.size} non-negative sizes that add up to dim 0",
            )
