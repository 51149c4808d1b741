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

MODES = ("sync", "async")
"""The values of ``diloco_mode``."""

RENAMED = {"asynchronous": "diloco_mode='async' (with servers=)"}
"""Options of other DiLoCo implementations and what gradhub calls them."""


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
    bits everywhere); no error feedback. With ``servers``: the pushes' wire codec
    (elementwise codecs only: ``"bf16"``, ``"fp16"``, ...; the servers decode and
    sum in fp32)."""
    servers: bool | str | list[str] | None = None
    """Parameter servers that hold the shared weights and run the outer optimizer
    (:mod:`.servers`): their addresses (``"tcp://HOST:PORT"``, or a list), or
    ``True`` for those ``gradhub run --servers S`` published. ``None`` (the
    default): no servers; the pseudo-gradients are averaged on the job's group
    and every rank runs the outer step."""
    diloco_mode: str = "sync"
    """``"sync"``: every worker's pseudo-gradient in one outer step (servers in
    mode ``sync``, or no servers). ``"async"`` (needs ``servers``, in mode
    ``ssp``): each worker's pseudo-gradient is one outer step of its own, taken
    when that worker syncs; a worker more than the servers' ``max_staleness``
    syncs ahead of the slowest waits for it."""
    secret: str | bytes | None = None
    """With ``servers``: the servers' shared secret, when they require one."""
    timeout: float = 60.0
    """With ``servers``: seconds a push or pull may take (waiting for a sync round
    or for a worker behind included) before an error."""

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
        if self.diloco_mode not in MODES:
            raise InvalidOptionError(
                f"diloco_mode must be one of {', '.join(map(repr, MODES))}, got "
                f"{self.diloco_mode!r}\n- help: 'async' (with servers=) lets each worker sync "
                "when it is ready"
            )
        self._check_servers()

    def _check_servers(self) -> None:
        servers = self.servers
        if isinstance(servers, str):
            servers = self.servers = [servers]
        if servers is None or servers is False:
            self.servers = None
            if self.diloco_mode == "async":
                raise InvalidOptionError(
                    "diloco_mode='async' needs servers=: without them the workers average "
                    "their pseudo-gradients together, at the same step\n- help: pass "
                    "servers=['tcp://HOST:PORT', ...] (or True under `gradhub run --servers S "
                    "--ps-mode ssp`), or drop diloco_mode"
                )
            return
        if servers is not True and (
            not isinstance(servers, list | tuple)
            or not servers
            or not all(isinstance(a, str) for a in servers)
        ):
            raise InvalidOptionError(
                f"servers must be an address, a non-empty list of addresses, or True, got "
                f"{servers!r}\n- help: servers=['tcp://HOST:PORT'], or servers=True for those "
                "`gradhub run --servers S` published"
            )
        if not self.timeout > 0:
            raise InvalidOptionError(
                f"timeout must be > 0 seconds, got {self.timeout!r}\n- help: the default is 60"
            )
        codec = codecs.get(self.compress, for_="diloco")
        if not codec.elementwise:
            raise UnsupportedOptionError(
                f"compress={codec.name!r} does not go with servers=: a push to the servers "
                "is cut into slices (a key may span servers), and a tensor codec is decoded "
                f"whole\n- help: compress='bf16' or 'fp16' ({', '.join(codecs.available())}), "
                "or no servers"
            )


def check_option_names(options: Iterable[str]) -> None:
    known = {f.name for f in fields(DiLoCoConfig)}
    for name in options:
        if name in RENAMED:
            raise UnsupportedOptionError(
                f"strategy 'diloco' has no option {name}=\n- help: write {RENAMED[name]}"
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
    "MODES",
    "RENAMED",
    "DiLoCoConfig",
    "OuterOptimizer",
    "build_outer",
    "check_option_names",
]
