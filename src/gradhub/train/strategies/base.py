"""The strategy interface: how replicas are kept in step across ranks.

A strategy is what :func:`gradhub.prepare` attaches to a model and its
optimizer; the user's own loop (``zero_grad``, ``backward``, clip, ``step``)
drives it, and ``fit`` drives the very same path. Contract, for every
strategy (one module each):

- :meth:`Strategy.setup` is called once per process, after ``gradhub.init()``,
  with the model (already on ``runtime.device``), the user's optimizer (only
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
- Loss scaling (:class:`gradhub.GradScaler`, ``precision="fp16"``): after the
  synchronising backward, :meth:`unscale_` multiplies the *combined*
  gradient (the one :meth:`apply` and :meth:`clip_grad_norm_` use) by
  ``1 / scale`` and says whether it holds inf or NaN. Every rank whose
  update depends on the others' (``allreduce``, ``sharded``, ``ps-sync``)
  gets the same answer; ``ps-async``/``ps-ssp`` decide per worker, since a
  worker's push is applied on its own. On "found inf" the scaler calls
  :meth:`skip` instead of :meth:`apply`: no update, the per-step bookkeeping
  is reset as by a step. A skipped step counts in :attr:`steps` (the loop's
  step count, as ``fit`` and its checkpoints count) and in
  :attr:`skipped_steps`. :meth:`use_loss_scaling` tells the strategy that
  gradients are scaled from now on, so that a wire codec lets an overflow
  through as inf instead of saturating it into a finite, wrong value.
- A peer that dies or stops answering makes a step raise
  :class:`~gradhub.errors.WorkerFailedError` naming it, or
  :class:`~gradhub.errors.CollectiveTimeoutError`, within the runtime's
  timeout: never a hang.

Misuse (each a :class:`~gradhub.errors.MisuseError`, an error rather than a
warning because each one makes ranks diverge or collectives mismatch):
stepping the optimizer handed to ``prepare``; a second synchronising backward
before ``step`` (ranks that ran a different number of them would pair
mismatched collectives; use ``no_sync()`` for every micro-batch but the last,
or sum the losses); ``step`` with no synchronising backward since the last one.
All three are errors under every strategy, the ``ps-*`` ones included, where
a backward communicates nothing (see :mod:`.ps` for why).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from gradhub.errors import ClosedError, MisuseError, StateError
from gradhub.runtime import Runtime

Closure = Callable[[], torch.Tensor]
"""Runs the forward pass on the local batch and returns its mean loss."""


class Strategy(abc.ABC):
    """One way of keeping data-parallel replicas in step."""

    name: ClassVar[str]
    """The name users pass as ``strategy=``."""

    needs_optimizer: ClassVar[bool] = True
    """Whether :meth:`setup` requires the user's optimizer."""

    state_outlives_workers: ClassVar[bool] = False
    """Whether the parameters and optimizer state live outside the worker
    processes (the parameter servers of ``ps-*``), so that they outlive a
    worker restart and a restarted worker takes them from there."""

    def __init__(self) -> None:
        self._runtime: Runtime | None = None
        self._closed = False
        self.steps = 0
        """Optimizer steps completed by this process (skipped ones included)."""
        self.skipped_steps = 0
        """Steps skipped by a loss scaler for an overflow (see :meth:`skip`)."""
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.params: list[torch.nn.Parameter] = []
        self.sync = True
        """False inside :meth:`no_sync`: backward passes only accumulate locally."""
        self._samples: tuple[int, int | None] | None = None
        self._in_backward = False
        self._synced = False  # a synchronising backward ran since the last step
        self._stepping = False  # the original optimizer may be stepped (by us)
        self._handles: list[Any] = []

    @property
    def runtime(self) -> Runtime:
        if self._closed:
            raise ClosedError(f"strategy {self.name!r} was closed")
        if self._runtime is None:
            raise StateError(f"strategy {self.name!r} is not set up; call setup() first")
        return self._runtime

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    def setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        runtime: Runtime,
    ) -> None:
        """Attach to a model and optimizer; replicas start equal after this."""
        if self._runtime is not None:
            raise StateError(f"strategy {self.name!r} is already set up")
        if optimizer is None and self.needs_optimizer:
            raise ValueError(f"strategy {self.name!r} needs the training script's optimizer")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer)!r}")
        runtime.check_open()
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the model has no parameters that require gradients")
        if optimizer is not None:
            known = {id(p) for g in optimizer.param_groups for p in g["params"]}
            if any(id(p) not in known for p in self.params):
                raise ValueError(
                    "the optimizer does not hold every trainable parameter of the model\n"
                    "- help: build it over model.parameters() before gradhub.prepare"
                )
        self._runtime, self.model, self.optimizer = runtime, model, optimizer
        self._setup(model, optimizer)
        for p in self.params:
            self._handles.append(p.register_hook(self._before_grad))
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._guard_original))

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
        bad_total = global_samples is not None and (global_samples <= 0 or samples > global_samples)
        if samples < 0 or bad_total:
            raise ValueError(
                f"need 0 <= samples <= global_samples and global_samples > 0, "
                f"got samples={samples}, global_samples={global_samples}"
            )
        self._samples = (int(samples), None if global_samples is None else int(global_samples))

    def _before_grad(self, grad: torch.Tensor) -> None:
        # Runs before the gradient is accumulated into ``.grad``: a refused
        # backward leaves every gradient as it was.
        if not self._in_backward and self.sync and self._synced:
            raise MisuseError(
                "a second backward() before optimizer.step(), outside no_sync(): a backward "
                "outside no_sync() ends the step's gradient (allreduce and sharded combine it "
                "across ranks during that backward, so ranks would pair mismatched "
                "collectives); every strategy refuses it, so a loop runs unchanged under "
                "each\n- help: run every micro-batch but the last under "
                "`with model.no_sync():`, or add the losses and call backward once"
            )

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            if self.sync:
                self._begin_sync()
        if self.sync:
            self._grad_ready(p)

    def _backward_end(self) -> None:
        self._in_backward = False
        if self.sync:
            self._finish_backward()
            self._synced = True

    def _guard_original(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._stepping:
            raise MisuseError(
                "this optimizer was handed to gradhub.prepare and must not be stepped "
                "directly: the ranks would drift apart\n- help: call step() on the optimizer "
                "that gradhub.prepare returned"
            )

    def apply(self) -> None:
        """The prepared optimizer's ``step``: combine every rank's gradients, update."""
        if self._in_backward:
            raise MisuseError("optimizer.step() called during backward()")
        if not self._synced:
            raise MisuseError(
                "optimizer.step() without a backward() outside no_sync() since the last "
                "step: nothing ended the step's gradient (under allreduce and sharded it "
                "would never have been combined across ranks); every strategy refuses it"
                "\n- help: run the last micro-batch's backward outside "
                "`with model.no_sync():`"
            )
        self._stepping = True
        try:
            self._apply()
        finally:
            self._stepping = False
            self._synced = False
            self._samples = None
        self._step_done()

    def _step_done(self) -> None:
        # An LR scheduler made on the original optimizer counts that optimizer's
        # steps; where it is not stepped itself, record the step the scheduler expects.
        opt = self.optimizer
        if opt is not None and hasattr(opt.step, "_wrapped_by_lr_sched"):
            opt._opt_called = True  # type: ignore[attr-defined]
        self.steps += 1

    # loss scaling (gradhub.GradScaler) ---------------------------------------------

    def use_loss_scaling(self) -> None:
        """Gradients are loss-scaled from now on (called by :class:`gradhub.GradScaler`).

        Default: nothing to change. A strategy whose wire codec saturates
        (``sharded`` with ``compress="fp16"``) switches to one that turns an
        overflow into inf, so :meth:`unscale_` finds it.
        """
        return None

    def unscale_(self, inv_scale: float) -> bool:
        """Multiply the combined gradient by ``inv_scale``; True if it holds inf or NaN.

        Call it after the synchronising backward, before :meth:`clip_grad_norm_`
        and :meth:`apply` / :meth:`skip`. The answer is the same on every rank
        that shares the step (see the module docstring).
        """
        self._check_step_ready("unscale_")
        return self._unscale(float(inv_scale))

    def _unscale(self, inv_scale: float) -> bool:
        """Default: the ``.grad`` of the parameters is the combined gradient,
        the same bits on every rank (``allreduce``), so a local check agrees."""
        return unscale_tensors([p.grad for p in self.params if p.grad is not None], inv_scale)

    def skip(self) -> None:
        """End this step without an update (a loss scaler found inf).

        Resets the per-step bookkeeping as :meth:`apply` does, so the next
        backward is the next step's; counts in :attr:`steps` and
        :attr:`skipped_steps`. Every rank that shares the step skips it
        (the scaler's agreed decision); under ``ps-ssp`` the skip still
        advances this worker's clock on the servers (see :mod:`.ps`).
        """
        self._check_step_ready("skip")
        try:
            self._skip()
        finally:
            self._synced = False
            self._samples = None
        self.skipped_steps += 1
        self._step_done()

    def _skip(self) -> None:
        """Drop what this step prepared for :meth:`_apply` (default: nothing)."""
        return None

    def _agree(self, found: bool) -> bool:
        """True on every rank if ``found`` on any (one all-reduce of a flag)."""
        flag = torch.tensor([1.0 if found else 0.0], device=self.params[0].device)
        return bool(self.runtime.all_reduce_sum(flag, where="loss scaling: found inf")[0] > 0)

    def _check_step_ready(self, what: str) -> None:
        if self._in_backward:
            raise MisuseError(f"{what} called during backward()")
        if not self._synced:
            raise MisuseError(
                f"{what} without a backward() outside no_sync() since the last step: the "
                "gradients were never combined across ranks\n- help: call it after the "
                "last micro-batch's backward, before optimizer.step()"
            )

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
        # torch's load_state_dict replaces the group list and dicts and the state:
        # the prepared optimizer and an LR scheduler made before the load would
        # keep the old ones. Keep the same objects, with the loaded values.
        opt = self.optimizer
        groups, per_param = opt.param_groups, opt.state
        opt.load_state_dict(state)
        for old, new in zip(groups, opt.param_groups, strict=True):
            old.update(new)
        per_param.clear()
        per_param.update(opt.state)
        opt.param_groups, opt.state = groups, per_param

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
            return 1.0 / self.world_size, False
        n, total = self._samples
        if total is not None:
            return n / total, False
        return float(n), True

    def _check_counts(self, samples: int, global_samples: int) -> None:
        if samples < 0 or global_samples <= 0 or samples > global_samples:
            raise ValueError(
                f"need 0 <= samples <= global_samples and global_samples > 0, "
                f"got samples={samples}, global_samples={global_samples}"
            )

    def _broadcast_from_rank0(self, model: torch.nn.Module) -> None:
        """Give every replica rank 0's parameters and floating-point buffers."""
        tensors = [t.data for t in model.parameters()] + list(model.buffers())
        tensors = [t for t in tensors if t.is_floating_point()]
        if self.runtime.world_size == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        self._wait(dist.broadcast(flat, src=0, async_op=True), "broadcast")
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def _wait(self, work: Any, operation: str) -> None:
        """Bounded wait on a c10d work item; failures name the rank(s) responsible."""
        self.runtime.wait(work, operation, where=f"step {self.steps} of strategy {self.name!r}")


def unscale_tensors(tensors: list[torch.Tensor], inv_scale: float) -> bool:
    """Multiply ``tensors`` in place by ``inv_scale``; True if any holds inf or NaN.

    torch's own kernel (the one ``torch.amp.GradScaler`` uses), so the bits
    match a single-process run under torch's scaler.
    """
    if not tensors:
        return False
    found = torch.zeros(1, dtype=torch.float32, device=tensors[0].device)
    inv = torch.full((1,), inv_scale, dtype=torch.float32, device=tensors[0].device)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv)
    return bool(found.item() > 0)
