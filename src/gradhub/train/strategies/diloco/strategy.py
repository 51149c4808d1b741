"""The ``diloco`` strategy: :class:`DiLoCoStrategy` (the package docstring says
what it does, line by line of DDP's loop)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from gradhub import codecs
from gradhub._config import config_or_options
from gradhub.collective import all_reduce
from gradhub.errors import (
    InvalidOptionError,
    MisuseError,
    ShapeMismatchError,
    UnsupportedByStrategyError,
)
from gradhub.train.strategies.base import Strategy, load_keeping_objects
from gradhub.train.strategies.diloco import exchange, fragments
from gradhub.train.strategies.diloco.config import DiLoCoConfig, build_outer, check_option_names
from gradhub.train.strategies.diloco.resync import Resync
from gradhub.train.strategies.diloco.servers import OuterServers, ServerSync
from gradhub.train.strategies.survival import PEER_FAILURES

_WIDTHS = (torch.float32, torch.bfloat16, torch.float16)
_CHECKED = 64
"""Backward counts are compared modulo this (exact fp32 sums up to 4096 ranks)."""


class DiLoCoStrategy(Resync, Strategy):
    """Inner steps on each worker; every H-th step (per fragment, at its offset), an
    outer step on the averaged pseudo-gradient, which every worker takes."""

    name = "diloco"
    survives = True

    def __init__(self, config: DiLoCoConfig | None = None, **options: Any) -> None:
        super().__init__()
        check_option_names(options)
        self.config = config_or_options(DiLoCoConfig, config, options)
        self.outer: torch.optim.Optimizer | None = None
        """The outer optimizer (over :attr:`shared`), built at set-up."""
        self.shared: list[torch.Tensor] = []
        """The shared fp32 weights of the last sync, one per trainable parameter
        (with servers, a fragment's take the pulled weights as they arrive)."""
        self.inner_done = 0
        """Inner steps taken since the last sync of fragment 0 (the step count mod H)."""
        self.fragments: list[range] = []
        """The parameter indices of each fragment (:func:`.fragments.cut`)."""
        self.offsets = fragments.offsets(self.config.inner_steps, self.config.fragments)
        """The step in each period of H at which each fragment syncs."""
        self.codec = codecs.get(self.config.compress, for_="diloco")
        count = self.config.fragments
        self._samples_seen: list[float | None] = [None] * count  # set_samples counts
        self._plain = [0] * count  # steps without set_samples since the fragment's sync
        self._backwards = [0] * count  # backward passes outside no_sync() since then
        self._globals: list[float | None] = [0.0] * count  # global_samples, if every step had it
        self.servers: OuterServers | None = None
        """The parameter servers' client (``servers=``), connected at set-up."""
        self._pending: exchange.Pending | None = None
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
        if self.config.fragments > len(self.params):
            raise InvalidOptionError(
                f"fragments={self.config.fragments} but the model has {len(self.params)} "
                "trainable parameters; a fragment holds whole parameters\n- help: at most "
                f"fragments={len(self.params)}"
            )
        self._refuse_under_survival()
        # The outer optimizer first: a bad one is refused before anything changes.
        shared = [p.detach().float().clone() for p in self.params]
        self.outer = build_outer(self.config.outer_optimizer, shared)
        self._broadcast_from_rank0(model)
        with torch.no_grad():
            for s, p in zip(shared, self.params, strict=True):
                s.copy_(p)
        self.shared = shared
        self.fragments = fragments.cut([p.numel() for p in self.params], self.config.fragments)
        offset = 0
        for p in self.params:
            self._slices.append((offset, p.numel()))
            offset += p.numel()
        self._flat = torch.zeros(offset, dtype=torch.float32, device=self.params[0].device)
        self._tally = exchange.Tally(self.runtime.group.device)
        if self.config.servers is not None:  # they hold the shared weights from now on
            name_of = {id(p): n for n, p in model.named_parameters()}
            names = [name_of[id(p)] for p in self.params]
            self.servers = OuterServers(self.config, self.runtime, names, shared, self.outer)
            with torch.no_grad():
                for s, p in zip(shared, self.params, strict=True):
                    p.copy_(s)

    def register_comm_hook(self, state: object, hook: Callable[..., Any]) -> None:
        raise MisuseError(
            "register_comm_hook is not available under strategy 'diloco': no backward "
            "communicates, and the pseudo-gradients travel at each sync as compress= says"
            "\n- help: drop the register_comm_hook line (diloco's compress= takes codecs)"
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
        for f in range(len(self._backwards)):
            self._backwards[f] += 1

    def _apply(self) -> None:
        self._count_samples()
        self._step_optimizer(self._current)

    def _skip(self) -> None:
        self._count_samples()

    def _count_samples(self) -> None:
        for f, seen in enumerate(self._samples_seen):
            if self._samples is None:
                self._plain[f] += 1
            else:
                self._samples_seen[f] = (seen or 0.0) + self._samples[0]
            known, total = self._globals[f], None if self._samples is None else self._samples[1]
            self._globals[f] = None if known is None or total is None else known + total

    def _rank_weight(self, f: int) -> float:
        """1 (the plain mean) without ``set_samples`` since fragment ``f``'s last sync,
        else the samples given plus 1 per step without it."""
        seen = self._samples_seen[f]
        if seen is None:
            return 1.0
        return seen + self._plain[f]

    def _step_done(self) -> None:
        super()._step_done()
        self.inner_done = (self.inner_done + 1) % self.config.inner_steps
        try:
            self._sync_due()
        except PEER_FAILURES as exc:  # survival: the sync again over the survivors
            self._sync_failed(exc)

    def _sync_due(self) -> None:
        """Merge the exchange whose overlap ended; start (and, with ``overlap=0``,
        merge) the sync of the fragment whose offset this step is."""
        pending = self._pending
        if pending is not None:
            pending.remaining -= 1
            if pending.remaining <= 0:
                self._merge()
        for f, offset in enumerate(self.offsets):
            if offset == self.inner_done:
                self._start(f)
                assert self._pending is not None
                if self._pending.remaining == 0:
                    self._merge()

    def _span(self, f: int) -> tuple[int, int]:
        """Fragment ``f``'s elements in the flat buffer: (start, end)."""
        first, last = self.fragments[f][0], self.fragments[f][-1]
        return self._slices[first][0], self._slices[last][0] + self._slices[last][1]

    def _start(self, f: int) -> None:
        """Fragment ``f``'s pseudo-gradient, weighted, sent (see the package docstring)."""
        lo, hi = self._span(f)
        flat, members = self._flat[lo:hi], self.fragments[f]
        with torch.no_grad():
            for i in members:
                offset, size = self._slices[i]
                s, p = self.shared[i], self.params[i]
                delta = self._flat[offset : offset + size].view_as(p)
                if p.dtype == torch.float32:
                    torch.sub(s, p.detach(), out=delta)
                else:  # against what the worker started from; the difference in fp32
                    delta.copy_(s.to(p.dtype))
                    delta.sub_(p.detach())
            weight = self._rank_weight(f)
            if self.config.diloco_mode == "async":  # this worker's share (see .servers)
                known = self._globals[f]
                seen = self._samples_seen[f]
                share = 1.0 / self.world_size
                if known and seen is not None and not self._plain[f]:
                    share = seen / known
                flat.mul_(share)
            elif weight != 1.0:
                flat.mul_(weight)
            tau = self.config.overlap
            start = None
            if tau:  # where the local progress of the next tau steps starts
                start = [self.params[i].detach().to(torch.float32, copy=True) for i in members]
        self._keep(f, flat, weight)
        count = self._backwards[f] % _CHECKED
        self._tally.write([weight, float(count), float(count * count), self._sees_joining()])
        self._samples_seen[f], self._plain[f], self._backwards[f] = None, 0, 0
        self._globals[f] = 0.0
        job: exchange.Exchange | ServerSync
        if self.servers is None:
            job = exchange.start(flat, self._tally.tensor, self.codec, self.runtime.group)
        else:
            if self.config.diloco_mode == "sync":  # divided by the summed weights first
                all_reduce(self._tally.tensor, group=self.runtime.group).wait()
                total = self._check_tally(self._tally.read())
                if total != 1.0:
                    flat.div_(total)
            spans = [(i, *self._slices[i]) for i in members]
            views = [self._flat[o : o + n].view_as(self.shared[i]) for i, o, n in spans]
            self.servers.push(members, views)
            job = self.servers.pull(members)
        self._pending = exchange.Pending(f, job, start, tau)

    def _check_tally(self, tally: list[float]) -> float:
        """The summed weights, once the summed tally says every worker made the same
        number of backward passes since the last sync and some weight is > 0."""
        total, counts, squares = tally[:3]
        if self.world_size * squares != counts * counts:
            raise MisuseError(
                f"at the sync after step {self.steps} the workers made different numbers of "
                "backward passes outside no_sync() since the last sync: their steps are no "
                "longer matched (torch.amp.GradScaler skips step() on the workers whose "
                "gradient overflowed)\n- help: use gradhub.GradScaler(optimizer), whose "
                "skipped step counts as an inner step, and the same loop on every rank"
            )
        if total <= 0:
            raise InvalidOptionError(
                "no rank processed any sample since the last sync (set_samples(0) on every "
                "step of every rank): there is no pseudo-gradient to average\n- help: give "
                "set_samples the number of samples of the rank's batch, > 0 on some rank"
            )
        return total

    def _merge(self) -> None:
        """The outer step of the pending fragment; the same on every rank."""
        assert self.outer is not None and self._pending is not None
        pending, self._pending = self._pending, None
        f = pending.fragment
        members = self.fragments[f]
        if isinstance(pending.job, ServerSync):  # the servers took the outer step
            pending.job.wait()
        else:
            flat, _ = pending.job.wait()
            tally = self._tally.read()
            total = self._check_tally(tally)
            self._regroup_after = self.runtime.survive and tally[3] > 0
            with torch.no_grad():
                if total != 1.0:
                    flat.div_(total)
                for i in members:
                    offset, size = self._slices[i]
                    shared = self.shared[i]
                    shared.grad = self._flat[offset : offset + size].view_as(shared)
                self.outer.step()
                for i in members:
                    self.shared[i].grad = None
        with torch.no_grad():
            for k, i in enumerate(members):
                s, p = self.shared[i], self.params[i]
                if pending.start is None:
                    p.copy_(s)
                else:  # the new shared weights plus the progress made since the start
                    p.copy_(s + (p.detach().float() - pending.start[k]))
        self._applied = True  # the outer step is in: a regroup now must not redo it
        buffers = f == 0 and self.world_size > 1 and self.ddp.sync_buffers_at_forward
        buffers = buffers and self.config.diloco_mode == "sync"
        if buffers and self._buffers():
            self._broadcast(self._buffers(), 0)
        self._kept, self._applied = None, False

    # state ---------------------------------------------------------------------------

    def _pending_state(self) -> dict[str, Any] | None:
        """The exchange in flight, waited for (it was started on every rank; waiting
        starts nothing): its fragment, steps to go, summed pseudo-gradient and
        tally (with servers: none, the pulled shared weights are in place), and
        where the local progress started."""
        pending = self._pending
        if pending is None:
            return None
        out = {
            "fragment": pending.fragment,
            "remaining": pending.remaining,
            "sum": None,
            "tally": None,
            "start": None if pending.start is None else [t.clone() for t in pending.start],
        }
        if isinstance(pending.job, ServerSync):
            pending.job.wait()
            return out
        flat, _ = pending.job.wait()
        return {**out, "sum": flat.detach().clone(), "tally": self._tally.read()}

    def _load_pending(self, saved: dict[str, Any] | None) -> None:
        if self._pending is not None:  # its sum is about to land in the flat buffer
            self._pending.job.wait()
        if saved is None:
            self._pending = None
            return
        f = int(saved["fragment"])
        start = saved["start"]
        start = None if start is None else [t.clone() for t in start]
        if (saved["sum"] is None) != (self.servers is not None):
            raise InvalidOptionError(
                "this state was saved with a sync in flight "
                f"{'without' if self.servers is not None else 'with'} servers=; it "
                "resumes only under the same setting\n- help: load it into a strategy "
                "with the same servers= as the run that saved it"
            )
        if self.servers is not None:  # the pulled weights came with the shared ones
            job = ServerSync([], self.config.timeout)
            self._pending = exchange.Pending(f, job, start, int(saved["remaining"]))
            return
        lo, hi = self._span(f)
        flat = self._flat[lo:hi]
        if saved["sum"].shape != flat.shape:
            raise ShapeMismatchError("the pending exchange's sum", flat.shape, saved["sum"].shape)
        with torch.no_grad():
            flat.copy_(saved["sum"])
        self._tally.write(list(saved["tally"]))
        self._pending = exchange.Pending(
            f, exchange.Exchange(flat, self._tally.tensor, []), start, int(saved["remaining"])
        )

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state dict plus ``"diloco"``: the shared weights,
        the outer optimizer's state (``None`` with servers: they hold it), the
        progress since each fragment's last sync, an exchange in flight (waited
        for). Local."""
        assert self.optimizer is not None and self.outer is not None
        out = self.optimizer.state_dict()
        pending = self._pending_state()  # first: with servers, its pull lands in shared
        outer = None if self.servers is not None else copy.deepcopy(self.outer.state_dict())
        out["diloco"] = {
            "shared": [s.detach().clone() for s in self.shared],
            "outer": outer,
            "inner_steps_done": self.inner_done,
            "samples": list(self._samples_seen),
            "plain_steps": list(self._plain),
            "backwards": list(self._backwards),
            "globals": list(self._globals),
            "pending": pending,
        }
        return out

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Takes a plain optimizer's state dict too (then only the inner part changes).
        With servers the saved outer state is not loaded: the servers hold theirs."""
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
            if len(ours["plain_steps"]) != len(self._plain):
                raise ShapeMismatchError(
                    "optimizer.state_dict()['diloco']['plain_steps']",
                    f"{len(self._plain)} fragments",
                    f"{len(ours['plain_steps'])} fragments",
                    "length",
                )
        load_keeping_objects(self.optimizer, inner)
        if ours is None:
            return
        with torch.no_grad():
            for mine, saved in zip(self.shared, shared, strict=True):
                mine.copy_(saved)
        if ours["outer"] is not None and self.servers is None:
            load_keeping_objects(self.outer, copy.deepcopy(ours["outer"]))
        self.inner_done = int(ours["inner_steps_done"])
        self._samples_seen = [None if v is None else float(v) for v in ours["samples"]]
        self._plain = [int(v) for v in ours["plain_steps"]]
        self._backwards = [int(v) for v in ours["backwards"]]
        known = ours.get("globals", [0.0] * len(self._plain))
        self._globals = [None if v is None else float(v) for v in known]
        self._load_pending(ours.get("pending"))

    def model_loaded(self) -> None:
        """The loaded weights become the shared ones (a checkpoint's optimizer
        state, loaded after the model, then brings the saved shared weights)."""
        with torch.no_grad():
            for s, p in zip(self.shared, self.params, strict=True):
                s.copy_(p)

    def close(self) -> None:
        """Waits for an exchange in flight (the other ranks take part in it), then
        releases what :class:`Strategy` holds."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                pending.job.wait()
        finally:
            if self.servers is not None:
                self.servers.close()
                self.servers = None
            super().close()


__all__ = ["DiLoCoStrategy"]
