"""The strategy interface: how replicas are kept in step across ranks.

A strategy is what :func:`gradhub.prepare` attaches to a model and its
optimizer; the user's own loop (``zero_grad``, ``backward``, clip, ``step``)
drives it, and ``fit`` drives the very same path. Contract, for every
strategy (one module each):

- :meth:`Strategy.setup` is called once per process, after ``gradhub.init()``,
  with the model (on the one device the script put it on), the user's optimizer (a
  list of them where :attr:`Strategy.several_optimizers`; only
  its class, hyperparameters and live ``param_groups`` are used where it is not
  stepped itself; ``None`` is allowed only by the parameter-server strategies)
  and the :class:`~gradhub.runtime.Runtime`. It makes every replica start
  from the same parameters.
- Backward passes are watched through post-accumulate-grad hooks on every
  parameter. Outside :meth:`no_sync` a backward pass *synchronises*: the
  strategy may start communication from :meth:`_grad_ready` (one call per
  parameter as its gradient is accumulated) and completes it in
  :meth:`_finish_backward` (called once, when backward ends). Inside
  ``no_sync`` gradients only accumulate locally.
- :meth:`apply` is the prepared optimizer's ``step``: combine the gradients
  of every rank and update the parameters (:meth:`_apply`). Every rank calls
  it the same number of times.
- Rank weights: by default every rank's gradient counts the same (the mean
  of the ranks' mean losses, as DDP). After :meth:`set_samples` (``samples``
  on this rank, optionally ``global_samples`` over all ranks) the next step
  combines ``sum(n_i g_i) / sum(n_i)``: the single-process step on the whole
  global batch, exact for uneven batches. It applies to that step only.
- :meth:`step` (``closure``, ``samples``, ``global_samples``) is one whole
  step built from the above; ``fit`` and the older tests use it. A rank with
  ``samples == 0`` still calls it (its closure is not called) so collectives
  stay matched.
- :meth:`clip_grad_norm_` clips by the norm of the combined gradient;
  :meth:`optimizer_state_dict` / :meth:`load_optimizer_state_dict` hold the
  full optimizer state in the single-process optimizer's own format.
- :meth:`refresh` brings the local model up to date with the shared
  parameters (a no-op where every step already leaves the replicas equal).
- :meth:`close` releases hooks, sockets and threads; idempotent.
- Loss scaling: :mod:`.scaling`.
- A peer that dies or stops answering makes a step raise
  :class:`~gradhub.errors.WorkerFailedError` naming it, or
  :class:`~gradhub.errors.CollectiveTimeoutError`, within the runtime's
  timeout: never a hang. In a surviving job (``gradhub run --survive``) the step
  applies nothing instead, and the job goes on over the survivors (:mod:`.survival`).

DDP's loop, line by line (decisions; DDP's documentation is the spec):

- Buffers, ``join()``, comm hooks: :mod:`.forward`.
- Whether a backward synchronises is decided as DDP decides it: by
  ``sync`` (``model.require_backward_grad_sync``, ``no_sync()``) at the
  model's last forward with grad enabled, else at the backward itself.
- A synchronising backward after another one, with no step in between, is
  allowed and does what DDP does: the local gradient accumulates onto what
  ``.grad`` holds (the combined gradient) and that is combined again.
- "Used" parameters: a parameter whose gradient was accumulated on some rank
  since the last synchronising backward (``no_sync`` micro-steps included).
  One no rank used keeps ``.grad`` as it was (``None`` after ``zero_grad``),
  so the optimizer does not move it (DDP ``find_unused_parameters=True``);
  every rank agrees (the flags are summed over the ranks in host memory with
  :class:`~.step_flags.StepFlags`, after the last bucket, or from
  :meth:`Strategy._finish_backward` in a strategy without buckets).
Misuse (each a :class:`~gradhub.errors.MisuseError`, an error rather than a
warning because each one makes ranks diverge or collectives mismatch):
stepping the optimizer handed to ``prepare``; ``step`` during backward;
``step`` with gradients accumulated inside ``no_sync`` and not combined by a
synchronising backward since. ``step`` with no backward at all since the last
step uses what ``.grad`` holds where the strategy can (``allreduce``: the
same bits on every rank); elsewhere it is refused (:meth:`_apply_unsynced`).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import torch

from gradhub.errors import (
    InvalidOptionError,
    MisuseError,
    StateError,
    UnsupportedByStrategyError,
    WrongTypeError,
)
from gradhub.runtime import Runtime
from gradhub.train.ddp_options import DDPOptions
from gradhub.train.strategies.forward import ForwardSide
from gradhub.train.strategies.join import Join
from gradhub.train.strategies.replicas import unscale_tensors
from gradhub.train.strategies.scaling import LossScaling
from gradhub.train.strategies.survival import PEER_FAILURES, Survival

Closure = Callable[[], torch.Tensor]
"""Runs the forward pass on the local batch and returns its mean loss."""

Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None
"""One optimizer, several over disjoint parameters (where supported), or none."""


class Strategy(LossScaling, ForwardSide, Survival, abc.ABC):
    """One way of keeping data-parallel replicas in step.

    Each of its parts (:mod:`.part`) lists what it needs of the strategy; this
    class provides all of it but two methods only some strategies have:
    ``_shadow_sync`` (where :attr:`supports_join`) and ``_rebind`` (survival).
    """

    name: ClassVar[str]
    """The name users pass as ``strategy=``."""

    needs_optimizer: ClassVar[bool] = True
    """Whether :meth:`setup` requires the user's optimizer."""

    state_outlives_workers: ClassVar[bool] = False
    """Whether the parameters and optimizer state live outside the worker
    processes (the parameter servers of ``ps-*``), so that they outlive a
    worker restart and a restarted worker takes them from there."""

    several_optimizers: ClassVar[bool] = False
    """Whether several optimizers over disjoint parameters (and parameters in
    none of them) are accepted; else one optimizer holds every trainable one."""

    def __init__(self) -> None:
        self.steps = 0
        """Optimizer steps completed by this process (skipped ones included)."""
        self.skipped_steps = 0
        """Steps skipped by a loss scaler for an overflow (see :meth:`skip`)."""
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        """Every optimizer handed to ``prepare`` (:attr:`optimizer` is the first)."""
        self.params: list[torch.nn.Parameter] = []
        self.sync = True
        """False inside :meth:`no_sync`: backward passes only accumulate locally."""
        self.ddp = DDPOptions()
        """DDP's keywords given to ``prepare`` (set before :meth:`setup`)."""
        self._samples: tuple[int, int | None] | None = None
        self._in_backward = False
        self._syncing = False  # the backward running now synchronises
        self._synced = False  # a synchronising backward ran since the last step
        self._local = False  # a no_sync backward ran since the last synchronising one
        self._used: set[int] = set()  # ids of parameters used since the last sync
        self._sync_at_forward: bool | None = None
        self._forward_param_sync = True  # DDP's require_forward_param_sync
        self._join: Join | None = None
        self._stepping = False  # the original optimizer may be stepped (by us)
        self._current = 0  # index of the optimizer being stepped
        self._handles: list[Any] = []

    def setup(self, model: torch.nn.Module, optimizer: Optimizers, runtime: Runtime) -> None:
        """Attach to a model and optimizer(s); replicas start equal after this."""
        if self._runtime is not None:
            raise StateError(f"strategy {self.name!r} is already set up")
        optimizers = self._check_optimizers(optimizer)
        runtime.check_open()
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise InvalidOptionError("the model has no parameters that require gradients")
        held = [id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]]
        if len(held) != len(set(held)):
            raise InvalidOptionError(
                "a parameter is in two optimizers (or twice in one)\n- help: give each "
                "optimizer its own parameters"
            )
        if optimizers and not self.several_optimizers and set(map(id, self.params)) - set(held):
            raise InvalidOptionError(
                "the optimizer does not hold every trainable parameter of the model\n"
                "- help: build it over model.parameters() before gradhub.prepare, or "
                "use strategy='allreduce'"
            )
        self._runtime, self.model = runtime, model
        self.optimizers = optimizers
        self.optimizer = optimizers[0] if optimizers else None
        self._join_survival(runtime)
        self._setup(model, self.optimizer)
        self._set_up_joined()
        for p in self.params:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for opt in optimizers:
            self._handles.append(opt.register_step_pre_hook(self._guard_original))

    def _check_optimizers(self, optimizer: Optimizers) -> list[torch.optim.Optimizer]:
        if optimizer is None:
            if self.needs_optimizer:
                raise InvalidOptionError(
                    f"strategy {self.name!r} needs the training script's optimizer"
                )
            return []
        many: list[Any] = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
        for opt in many:
            if not isinstance(opt, torch.optim.Optimizer):
                raise WrongTypeError(f"an optimizer is a torch.optim.Optimizer, got {type(opt)!r}")
        if len(many) != 1 and not self.several_optimizers:
            raise UnsupportedByStrategyError(
                f"strategy {self.name!r} takes one optimizer, got {len(many)}\n- help: one "
                "optimizer with several param_groups, or strategy='allreduce'"
            )
        return many

    @abc.abstractmethod
    def _setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None: ...

    # the user's loop -------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients locally (as DDP's)."""
        before, self.sync = self.sync, False
        try:
            yield
        finally:
            self.sync = before

    def set_samples(self, samples: int, global_samples: int | None = None) -> None:
        """Weight this rank by ``samples`` in the next step (see the module docstring)."""
        self._check_counts(samples, global_samples)
        self._samples = (int(samples), None if global_samples is None else int(global_samples))

    def _on_grad(self, p: torch.Tensor) -> None:
        self._used.add(id(p))
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            at_forward, self._sync_at_forward = self._sync_at_forward, None
            self._syncing = self.sync if at_forward is None else at_forward
            if self._syncing:
                self._take_share()
                self._begin_sync()
        if self._syncing and self._failure is None:
            try:
                self._grad_ready(p)
            except PEER_FAILURES as exc:  # survival: the step is trained again
                self._failed(exc)

    def _backward_end(self) -> None:
        self._in_backward = False
        if not self._syncing:
            self._local = True
            return
        self._syncing = False
        if self._failure is None:
            try:
                self._finish_backward()
            except PEER_FAILURES as exc:
                self._failed(exc)
        self._synced, self._local = True, False
        self._used.clear()

    def _guard_original(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._stepping:
            raise MisuseError(
                "this optimizer was handed to gradhub.prepare and must not be stepped "
                "directly: the ranks would drift apart\n- help: call step() on the optimizer "
                "that gradhub.prepare returned"
            )

    def apply(self, index: int = 0) -> None:
        """The prepared optimizer's ``step`` (of optimizer ``index``): combine, update."""
        if self._in_backward:
            raise MisuseError("optimizer.step() called during backward()")
        if self._local:
            raise MisuseError(
                "optimizer.step() without a backward() outside no_sync() since a backward() "
                "inside no_sync(): those gradients were never combined across ranks\n"
                "- help: run the last micro-batch's backward outside "
                "`with model.no_sync():` (or with model.require_backward_grad_sync = True)"
            )
        self._current = index
        if self._failure is not None:
            self._recover()  # survival: no update; the same batch is trained again
            return
        if not self._synced:
            self._apply_unsynced()
            return
        self._stepping = True
        try:
            self._apply()
        except PEER_FAILURES as exc:
            self._failed(exc)
        finally:
            self._stepping = False
            self._synced = False
            self._samples = None
        if self._failure is not None:
            self._recover()
            return
        self._step_done()
        self._after_step()

    def _apply_unsynced(self) -> None:
        """``step`` with no backward since the last step (default: refused)."""
        raise MisuseError(
            "optimizer.step() without a backward() outside no_sync() since the last "
            f"step: under strategy {self.name!r} there is no combined gradient to apply"
            "\n- help: run the last micro-batch's backward outside `with model.no_sync():`"
        )

    def _step_optimizer(self, index: int) -> None:
        """Step the script's optimizer ``index`` itself (past the guard)."""
        self._stepping = True
        try:
            self.optimizers[index].step()
        finally:
            self._stepping = False

    def _step_done(self) -> None:
        # An LR scheduler made on the original optimizer counts that optimizer's
        # steps; where it is not stepped itself, record the step the scheduler expects.
        opt = self.optimizers[self._current] if self.optimizers else None
        if opt is not None and hasattr(opt.step, "_wrapped_by_lr_sched"):
            opt._opt_called = True  # type: ignore[attr-defined]
        self.steps += 1
        self.runtime.committed_steps += 1

    def step(self, closure: Closure, samples: int, global_samples: int) -> None:
        """One whole step: weights, backward (if ``samples``), combine, update."""
        self._check_counts(samples, global_samples)
        self.set_samples(samples, global_samples)
        for p in self.params:
            p.grad = None
        if samples > 0:
            closure().backward()
        self.sync_without_backward()
        self.apply()

    def sync_without_backward(self) -> None:
        """Take part in combining gradients without a backward pass of one's own
        (a rank with no sample in this step): contributes its accumulated
        gradients, zeros where there are none. No-op if a backward already synced."""
        if not self._synced:
            self._syncing = True
            self._begin_sync()
            self._backward_end()

    # what strategies implement ----------------------------------------------------

    def _begin_sync(self) -> None:
        """A synchronising backward starts (before its first :meth:`_grad_ready`)."""
        return None

    def _grad_ready(self, p: torch.Tensor) -> None:
        """``p.grad`` holds its accumulated gradient (synchronising backward only)."""
        return None

    def _finish_backward(self) -> None:
        """The synchronising backward ended (also called with no backward at all)."""
        return None

    @abc.abstractmethod
    def _apply(self) -> None:
        """Combine the gradients over the ranks and update the parameters."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the norm of the gradient :meth:`apply` will use; returns that norm."""
        return torch.nn.utils.clip_grad_norm_(self.params, max_norm, norm_type=norm_type)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The full optimizer state, in the single-process optimizer's format."""
        assert self.optimizer is not None
        return self.optimizer.state_dict()

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        assert self.optimizer is not None
        load_keeping_objects(self.optimizer, state)

    def model_loaded(self) -> None:
        """The local parameters were overwritten (a state dict was loaded) on every rank."""
        return None

    def refresh(self) -> None:
        """Make the local model reflect the shared parameters (default: nothing to do)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds beyond the model's parameters."""
        out: dict[str, Any] = {"steps": self.steps}
        if self.optimizer is not None:
            out["optimizer"] = self.optimizer_state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state.get("steps", 0))
        if self.optimizer is not None and "optimizer" in state:
            self.load_optimizer_state_dict(state["optimizer"])

    def close(self) -> None:
        """Release hooks, sockets and threads. Idempotent."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._closed = True

    # helpers shared by strategies -------------------------------------------------

    def _weights(self) -> tuple[float, bool]:
        """(factor for this rank's gradient, whether to divide the sum by the summed count).

        Default: 1 / world size (DDP's mean). With samples: ``n / global`` when
        the global count is known, else ``n``, and the strategy divides the sum
        by the sum of the counts.
        """
        if self._samples is None:
            divisor = self.world_size if self._join is None else self._join.divisor
            return 1.0 / divisor, False
        n, total = self._samples
        if total is not None:
            return n / total, False
        return float(n), True

    def _check_counts(self, samples: int, global_samples: int | None) -> None:
        bad_total = global_samples is not None and (global_samples <= 0 or samples > global_samples)
        if samples < 0 or bad_total:
            raise InvalidOptionError(
                f"need 0 <= samples <= global_samples and global_samples > 0, "
                f"got samples={samples}, global_samples={global_samples}"
            )


def load_keeping_objects(opt: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """``opt.load_state_dict(state)`` keeping its group list, group dicts and state dict.

    torch's load replaces them: the prepared optimizer and an LR scheduler made
    before the load would keep the old ones. Same objects, loaded values.
    """
    groups, per_param = opt.param_groups, opt.state
    opt.load_state_dict(state)
    for old, new in zip(groups, opt.param_groups, strict=True):
        old.update(new)
    per_param.clear()
    per_param.update(opt.state)
    opt.param_groups, opt.state = groups, per_param


__all__ = ["Closure", "Optimizers", "Strategy", "load_keeping_objects", "unscale_tensors"]
