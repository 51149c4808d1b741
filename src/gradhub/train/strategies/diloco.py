"""``diloco``: local steps, then an outer step on the averaged pseudo-gradient.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105): every worker trains on its
own for ``inner_steps`` (H) optimizer steps with the script's optimizer (the
*inner* one, AdamW in the paper), communicating nothing. At every H-th
``optimizer.step()`` the workers meet once:

1. each worker's pseudo-gradient is ``shared - local``: the shared weights
   of the last sync minus its weights now, in fp32;
2. one flat fp32 all-reduce on the job's group's transport
   (:func:`gradhub.collective.all_reduce`: shared memory on one host, the
   hierarchical path across hosts) sums them, each multiplied by its
   worker's weight, and the sum is divided by the summed weights (host data:
   a 3-float all-reduce behind the flat one, read from host memory, so a
   sync reads nothing back from a device, as ``step_flags`` does);
3. the *outer* optimizer (``outer_optimizer``, by default SGD with lr 0.7 and
   Nesterov momentum 0.9, as the paper) steps the shared fp32 weights with
   that average as their ``.grad``; every worker's model takes the new
   shared weights (rounded to the model's dtype for 16-bit parameters).

Every rank computes the same outer step on the same bits, so after a sync
the replicas are equal, and nothing but the sync travels: about H times
less than ``allreduce`` sends.

Decisions (DDP's loop, line by line, between syncs):

- ``loss.backward()`` communicates nothing, inside ``no_sync()`` or not:
  ``no_sync()`` and ``model.require_backward_grad_sync`` are accepted and
  change nothing (gradients accumulate locally either way, as on one
  process), and stepping after backward passes that all ran inside
  ``no_sync()`` is allowed (each worker steps on its own gradient anyway).
- ``optimizer.step()`` steps the script's optimizer on this worker's
  ``.grad`` (one *inner step*); every H-th call also runs the sync above.
  ``step`` with no backward since the last one steps on what ``.grad``
  holds, as one process would.
- ``torch.nn.utils.clip_grad_norm_`` and ``gradhub.clip_grad_norm_`` clip
  this worker's gradient by its own norm (no combined gradient exists
  between syncs). LR schedulers and ``param_group["lr"] = ...`` act on the
  inner optimizer, per inner step; the outer optimizer keeps its own
  settings (:attr:`DiLoCoStrategy.outer` takes a scheduler of its own).
- Loss scaling: :class:`gradhub.GradScaler` checks this worker's own
  gradient and skips its own overflowing steps; a skipped step counts as an
  inner step (the sync stays at every H-th ``step`` on every worker).
  ``torch.amp.GradScaler`` does not call ``step`` at all on a skipped step,
  so that worker's syncs would fall behind the others': the sync compares
  the number of backward passes outside ``no_sync()`` each worker made since
  the last one (a difference that is a multiple of 64 goes unseen) and
  raises :class:`~gradhub.errors.MisuseError` on every rank where they
  differ, before anything is changed (use ``gradhub.GradScaler``).
- Weights (``set_samples``): by default every worker counts the same, and
  the average is the plain mean over the workers (as DDP's mean of means).
  After ``model.set_samples(n)`` (or ``set_samples(n, global_n)``) the step
  counts ``n``: a worker's weight is the number of samples behind its
  pseudo-gradient since the last sync, and the average is
  ``sum(N_i d_i) / sum(N_i)``; ``global_n`` is only checked (the sum of the
  weights divides). Give ``set_samples`` on every step or on none: in an
  interval with some, a step without it counts 1. Skipped steps count their
  samples too.
- Buffers: rank 0's at set-up; then each worker's own between syncs (a
  broadcast at every forward would be communication), and rank 0's again at
  every sync (DDP's ``broadcast_buffers=True``; ``False`` keeps each
  worker's own).
- ``join()``, ``register_comm_hook`` and several optimizers are refused at
  their line with a typed error saying what to do.
- Parameters of dtype fp32, bf16 or fp16; the shared weights are fp32 (master
  weights), the pseudo-gradient of a 16-bit parameter is taken against the
  shared weights rounded to its dtype (what the worker started from).
- Checkpoints: ``model.state_dict()`` is this worker's own weights (between
  syncs they differ per worker); ``optimizer.state_dict()`` is the inner
  optimizer's own state dict (a plain optimizer loads it) plus a
  ``"diloco"`` entry: the shared weights, the outer optimizer's state, the
  inner steps since the last sync and the weight and backward count
  gathered since then. Neither call communicates (rank 0 alone may call
  them). Loaded after ``prepare`` on every rank (the model first, then the
  optimizer, as ``fit`` does), a worker continues bit for bit as if never
  stopped; for that each rank loads its own file (``fit`` writes one per
  rank), since the inner optimizer's state and the weights between syncs are
  per worker. ``model.load_state_dict`` alone (a pretrained model) makes
  the loaded weights the shared ones. A state loaded into the plain
  optimizer before ``prepare`` keeps only the inner part (torch's
  ``load_state_dict`` drops the ``"diloco"`` entry).
- :func:`gradhub.check_in_sync` between syncs reports the workers as
  diverged: they are, by design. Right after a sync it passes.

Not available yet (each a :class:`~gradhub.errors.UnsupportedOptionError`):
streaming fragments, compressed (fp4) pseudo-gradients, parameter servers
as the outer optimizer, asynchronous syncs.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields
from typing import Any

import torch

from gradhub._config import config_or_options
from gradhub.collective import all_reduce
from gradhub.errors import (
    InvalidOptionError,
    MisuseError,
    ShapeMismatchError,
    UnsupportedByStrategyError,
    UnsupportedOptionError,
)
from gradhub.train.strategies.base import Strategy, load_keeping_objects

OuterOptimizer = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""Builds the outer optimizer over the shared fp32 weights it is given."""

DEFAULT_OUTER: OuterOptimizer = functools.partial(
    torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True
)
"""The paper's outer optimizer: SGD, lr 0.7, Nesterov momentum 0.9."""

NOT_YET = {
    "fragments": "streaming DiLoCo (fragments synced at staggered steps)",
    "sync_delay": "overlapping the sync with inner steps (streaming DiLoCo)",
    "compress": "compressed pseudo-gradients (fp4, bf16)",
    "servers": "parameter servers running the outer optimizer",
    "asynchronous": "asynchronous syncs",
}
"""Options of DiLoCo's variants that gradhub does not have yet, and what each is."""

_WIDTHS = (torch.float32, torch.bfloat16, torch.float16)
_CHECKED = 64
"""Backward counts are compared modulo this (exact fp32 sums up to 4096 ranks)."""


@dataclass(kw_only=True)
class DiLoCoConfig:
    """Settings of the ``diloco`` strategy."""

    inner_steps: int = 100
    """H: optimizer steps each worker takes on its own between two syncs (>= 1)."""
    outer_optimizer: OuterOptimizer = DEFAULT_OUTER
    """Called once with the shared fp32 weights (a list of tensors, in the
    model's parameter order); returns the ``torch.optim.Optimizer`` that steps
    them at each sync, the averaged pseudo-gradient as their ``.grad``."""

    def __post_init__(self) -> None:
        h = self.inner_steps
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
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


class DiLoCoStrategy(Strategy):
    """Inner steps on each worker; every H-th step, an outer step on the averaged
    pseudo-gradient, then every worker takes the shared weights."""

    name = "diloco"

    def __init__(self, config: DiLoCoConfig | None = None, **options: Any) -> None:
        super().__init__()
        _check_option_names(options)
        self.config = config_or_options(DiLoCoConfig, config, options)
        self.outer: torch.optim.Optimizer | None = None
        """The outer optimizer (over :attr:`shared`), built at set-up."""
        self.shared: list[torch.Tensor] = []
        """The shared fp32 weights of the last sync, one per trainable parameter."""
        self.inner_done = 0
        """Inner steps taken since the last sync."""
        self._samples_seen: float | None = None  # set_samples counts since the last sync
        self._plain = 0  # steps without set_samples since the last sync
        self._backwards = 0  # backward passes outside no_sync() since the last sync
        self._flat = torch.zeros(0)
        self._slices: list[tuple[int, int]] = []

    # set-up ------------------------------------------------------------------------

    def _setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        odd = sorted({str(p.dtype) for p in self.params if p.dtype not in _WIDTHS})
        if odd:
            raise UnsupportedByStrategyError(
                f"strategy 'diloco' keeps fp32 shared weights of fp32, bf16 or fp16 "
                f"parameters; this model has {', '.join(odd)}\n- help: call model.float() "
                "(or .bfloat16()) before gradhub.prepare"
            )
        # The outer optimizer first: a bad one is refused before anything changes.
        shared = [p.detach().float().clone() for p in self.params]
        self.outer = _build_outer(self.config.outer_optimizer, shared)
        self._broadcast_from_rank0(model)
        with torch.no_grad():
            for s, p in zip(shared, self.params, strict=True):
                s.copy_(p)
        self.shared = shared
        offset = 0
        for p in self.params:
            self._slices.append((offset, p.numel()))
            offset += p.numel()
        self._flat = torch.zeros(offset, dtype=torch.float32, device=self.params[0].device)
        # The weight and the backward-count check: host data, summed in host memory
        # where the group carries host tensors (read through a NumPy view, no sync).
        self._tally = torch.zeros(3, dtype=torch.float32, device=self.runtime.group.device)
        self._tally_host = self._tally.numpy() if self._tally.device.type == "cpu" else None

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        raise MisuseError(
            "register_comm_hook is not available under strategy 'diloco': no backward "
            "communicates, and the pseudo-gradients travel in fp32 at each sync "
            "(compress= is not available under diloco yet)\n- help: drop the "
            "register_comm_hook line"
        )

    def before_forward(self) -> None:
        """Nothing: buffers follow rank 0 at each sync, not at each forward."""
        return None

    # the loop ------------------------------------------------------------------------

    def apply(self, index: int = 0) -> None:
        # Every backward is local here, inside no_sync() or not: a step always has
        # this worker's own gradient to use.
        self._local, self._synced = False, True
        super().apply(index)

    def _check_step_ready(self, what: str) -> None:
        if self._in_backward:
            raise MisuseError(f"{what} called during backward()")

    def _finish_backward(self) -> None:
        self._backwards += 1

    def _apply(self) -> None:
        self._count_samples()
        self._step_optimizer(self._current)

    def _skip(self) -> None:
        self._count_samples()

    def _count_samples(self) -> None:
        if self._samples is None:
            self._plain += 1
        else:
            self._samples_seen = (self._samples_seen or 0.0) + self._samples[0]

    def _rank_weight(self) -> float:
        """1 (the plain mean) without ``set_samples`` since the last sync, else the
        samples given plus 1 per step without it."""
        if self._samples_seen is None:
            return 1.0
        return self._samples_seen + self._plain

    def _step_done(self) -> None:
        super()._step_done()
        self.inner_done += 1
        if self.inner_done >= self.config.inner_steps:
            self._sync()

    def _sync(self) -> None:
        """The outer step (see the module docstring); the same on every rank."""
        assert self.outer is not None
        flat = self._flat
        with torch.no_grad():
            for (offset, size), s, p in zip(self._slices, self.shared, self.params, strict=True):
                delta = flat[offset : offset + size].view_as(p)
                if p.dtype == torch.float32:
                    torch.sub(s, p.detach(), out=delta)
                else:  # against what the worker started from; the difference in fp32
                    delta.copy_(s.to(p.dtype))
                    delta.sub_(p.detach())
            weight = self._rank_weight()
            if weight != 1.0:
                flat.mul_(weight)
        count = self._backwards % _CHECKED
        tally = [weight, float(count), float(count * count)]
        if self._tally_host is not None:
            self._tally_host[:] = tally
        else:
            self._tally.copy_(torch.tensor(tally), non_blocking=True)
        group = self.runtime.group
        summed = all_reduce(flat, group=group)
        all_reduce(self._tally, group=group).wait()  # after the big one, on every rank
        summed.wait()
        host = self._tally_host if self._tally_host is not None else self._tally.cpu().numpy()
        total, counts, squares = (float(v) for v in host)
        if self.world_size * squares != counts * counts:
            raise MisuseError(
                f"at the sync after step {self.steps} the workers made different numbers of "
                "backward passes outside no_sync() since the last sync: their steps are no "
                "longer matched (torch.amp.GradScaler skips step() on the workers whose "
                "gradient overflowed)\n- help: use gradhub.GradScaler(optimizer), whose "
                "skipped step counts as an inner step, and the same loop on every rank"
            )
        if total <= 0:
            raise ValueError(
                "no rank processed any sample since the last sync (set_samples(0) on every "
                "step of every rank): there is no pseudo-gradient to average"
            )
        with torch.no_grad():
            if total != 1.0:
                flat.div_(total)
            for (offset, size), s in zip(self._slices, self.shared, strict=True):
                s.grad = flat[offset : offset + size].view_as(s)
            self.outer.step()
            for s, p in zip(self.shared, self.params, strict=True):
                s.grad = None
                p.copy_(s)
        if self.world_size > 1 and self.ddp.sync_buffers_at_forward and self._buffers():
            self._broadcast(self._buffers(), 0)
        self.inner_done, self._samples_seen, self._plain, self._backwards = 0, None, 0, 0

    # state ---------------------------------------------------------------------------

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus ``"diloco"``: the shared weights,
        the outer optimizer's state, the progress since the last sync. Local."""
        assert self.optimizer is not None and self.outer is not None
        out = self.optimizer.state_dict()
        out["diloco"] = {
            "shared": [s.detach().clone() for s in self.shared],
            "outer": copy.deepcopy(self.outer.state_dict()),
            "inner_steps_done": self.inner_done,
            "samples": self._samples_seen,
            "plain_steps": self._plain,
            "backwards": self._backwards,
        }
        return out

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Takes a plain optimizer's state dict too (then only the inner part changes)."""
        assert self.optimizer is not None and self.outer is not None
        inner = {k: v for k, v in state.items() if k != "diloco"}
        ours = state.get("diloco")
        if ours is not None:
            shared = list(ours["shared"])
            if len(shared) != len(self.shared):
                raise ShapeMismatchError(
                    "optimizer.state_dict()['diloco']['shared']",
                    f"{len(self.shared)} tensors",
                    f"{len(shared)} tensors",
                    "length",
                )
            for i, (mine, saved) in enumerate(zip(self.shared, shared, strict=True)):
                if mine.shape != saved.shape:
                    raise ShapeMismatchError(f"shared weight {i}", mine.shape, saved.shape)
        load_keeping_objects(self.optimizer, inner)
        if ours is None:
            return
        with torch.no_grad():
            for mine, saved in zip(self.shared, shared, strict=True):
                mine.copy_(saved)
        load_keeping_objects(self.outer, copy.deepcopy(ours["outer"]))
        self.inner_done = int(ours["inner_steps_done"])
        seen = ours["samples"]
        self._samples_seen = None if seen is None else float(seen)
        self._plain = int(ours["plain_steps"])
        self._backwards = int(ours["backwards"])

    def model_loaded(self) -> None:
        """The loaded weights become the shared ones (a checkpoint's optimizer
        state, loaded after the model, then brings the saved shared weights)."""
        with torch.no_grad():
            for s, p in zip(self.shared, self.params, strict=True):
                s.copy_(p)


def _check_option_names(options: Iterable[str]) -> None:
    known = {f.name for f in fields(DiLoCoConfig)}
    for name in options:
        if name in NOT_YET:
            raise UnsupportedOptionError(
                f"strategy 'diloco' does not take {name}= yet: {NOT_YET[name]} is not "
                "available\n- help: drop it; diloco syncs every parameter every inner_steps "
                "steps, in fp32, on the job's group"
            )
        if name not in known:
            raise UnsupportedOptionError(
                f"strategy 'diloco' has no option {name}=\n- help: its options are "
                f"{', '.join(sorted(known))}"
            )


def _build_outer(make: OuterOptimizer, shared: list[torch.Tensor]) -> torch.optim.Optimizer:
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


__all__ = ["DEFAULT_OUTER", "NOT_YET", "DiLoCoConfig", "DiLoCoStrategy", "OuterOptimizer"]
