"""The ``diloco`` strategy's settings (:class:`DiLoCoConfig`) and the outer optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields

import torch

from gradhub import codecs
from gradhub.errors import InvalidOptionError, UnsupportedOptionError

OuterOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the outer optimizer over the shared fp32 weights it is given."""

DEFAULT_OUTER: OuterOptimizer = functools.partial(
    torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True
)
"""The paper's outer optimizer: SGD, lr 0.7, Nesterov momentum 0.9."""

NOT_YET = {
    "servers": "parameter servers running the outer optimizer",
    "asynchronous": "asynchronous syncs",
}
"""Options of DiLoCo's variants that gradhub does not have yet, and what each is."""


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(kw_only=True)
class DiLoCoConfig:
    """Settings of the ``diloco`` strategy."""

    inner_steps: int = 100
    """H: optimizer steps each worker takes on its own between two syncs (of a
    fragment) (>= 1)."""
    outer_optimizer: OuterOptimizer = DEFAULT_OUTER
    """Called once with the shared fp32 weights (a list of tensors, in the
    model's parameter order); returns the ``torch.optim.Optimizer`` that steps
    them at each sync, the averaged pseudo-gradient as their ``.grad`` (at a
    fragment's sync only that fragment's weights have a ``.grad``: torch's
    optimizers step only those, and keep their state per weight)."""
    fragments: int = 1
    """F (streaming DiLoCo): the trainable parameters cut into F contiguous
    groups of about equal size (:mod:`.fragments` states the rule), fragment
    ``f`` synced once per H steps at offset ``f * H // F``, each sync
    exchanging that fragment alone (1 <= F <= H, and at most the number of
    trainable parameters)."""
    overlap: int = 0
    """tau (streaming DiLoCo): a sync's exchange runs behind this many inner
    steps, and its outer step is merged after them (the local progress of
    those steps kept on top of the new shared weights); 0 (the default) is
    the blocking sync; ``0 <= overlap < inner_steps // fragments``."""
    compress: str | codecs.Codec = "none"
    """How the pseudo-gradients travel: ``"none"`` (an fp32 all-reduce), or a
    codec (``"bf16"``, ``"fp4"``, any of :func:`gradhub.codecs.available`
    ``(codecs.TENSOR)``): each rank's encoded pseudo-gradient is all-gathered,
    and every rank decodes them and sums them in fp32 in rank order (the same
    bits everywhere); no error feedback."""

    def __post_init__(self) -> None:
        h = self.inner_steps
        if not _int(h) or h < 1:
            raise InvalidOptionError(
                f"inner_steps must be an int >= 1, got {h!r}\n- help: the paper syncs every "
                "500 steps; inner_steps=1 is a synchronous step on the averaged update"
            )
        if not callable(self.outer_optimizer):
            raise InvalidOptionError(
                f"outer_optimizer must be a callable that takes the parameters and returns "
                f"a torch.optim.Optimizer, got {self.outer_optimizer!r}\n- help: e.g. "
                "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)"
            )
        f = self.fragments
        if not _int(f) or not 1 <= f <= h:
            raise InvalidOptionError(
                f"fragments must be an int from 1 to inner_steps ({h}), got {f!r}\n- help: "
                "each fragment syncs once per inner_steps steps, at its own step"
            )
        tau = self.overlap
        if not _int(tau) or not 0 <= tau < h // f:
            raise InvalidOptionError(
                f"overlap must be an int from 0 to inner_steps // fragments - 1 "
                f"({h // f - 1}), got {tau!r}\n- help: a fragment's exchange must be merged "
                "before the next fragment's starts; overlap=0 is the blocking sync"
            )
        self.compress = codecs.check(self.compress, for_="diloco")


def check_option_names(options: Iterable[str]) -> None:
    known = {f.name for f in fields(DiLoCoConfig)}
    for name in options:
        if name in NOT_YET:
            raise UnsupportedOptionError(
                f"strategy 'diloco' does not take {name}= yet: {NOT_YET[name]} is not "
                "available\n- help: drop it; diloco runs its outer step on every rank, "
                "after a blocking or overlapped exchange on the job's group"
            )
        if name not in known:
            raise UnsupportedOptionError(
                f"strategy 'diloco' has no option {name}=\n- help: its options are "
                f"{', '.join(sorted(known))}"
            )


def build_outer(make: OuterOptimizer, shared: list[torch.Tensor]) -> torch.optim.Optimizer:
    """``make(shared)``, checked: a torch optimizer over exactly those tensors."""
    outer = make(shared)
    if not isinstance(outer, torch.optim.Optimizer):
        raise InvalidOptionError(
            f"outer_optimizer returned {type(outer).__name__}, not a torch.optim.Optimizer"
            "\n- help: return the optimizer built over the parameters it is given, e.g. "
            "lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)"
        )
    held = [id(p) for g in outer.param_groups for p in g["params"]]
    if sorted(held) != sorted(id(s) for s in shared):
        raise InvalidOptionError(
            "the outer optimizer does not hold exactly the parameters outer_optimizer was "
            "given\n- help: build it over the list it is called with"
        )
    return outer


__all__ = [
    "DEFAULT_OUTER",
    "NOT_YET",
    "DiLoCoConfig",
    "OuterOptimizer",
    "build_outer",
    "check_option_names",
]
