"""ParameterStore: the key -> (value, optimizer) table behind a parameter server.

A plain, single-threaded object: no queue, no thread, no lock. The local and
the remote servers wrap it with their own concurrency; callers serialise access.

Decisions:

- ``init`` stores a detached copy of the value; its shape and dtype are fixed.
- Each key has its own optimizer, built once at ``init`` over ``[value]``, so
  optimizer state (momentum, Adam moments) lives with its key. Where it comes
  from (:meth:`ParameterStore.init`): the store's ``optimizer`` (an
  :class:`~gradhub.optim.OptimizerSpec` or a factory
  ``list[Tensor] -> torch.optim.Optimizer``), or the spec the ``init`` brings.
  When the store is ``fixed`` (the default when it has an optimizer), an
  ``init`` that brings a different spec is an ``OptimizerMismatchError`` naming
  both; otherwise the init's spec wins and the store's optimizer is the default
  for inits that bring none.
- No optimizer (``None``) follows MXNet's KVStore without an updater: a push
  *replaces* the value with the pushed sum, so the store aggregates (push
  gradients, pull their sum) instead of training.
- ``apply(key, grad, hyperparameters)`` runs exactly one optimizer step: the
  given hyperparameters (a worker's LR schedule) are set on the key's param
  group first, the value's ``.grad`` is set to ``grad``, ``step()`` runs,
  ``.grad`` is cleared again.
- ``optimizer_state(key)`` / ``set_optimizer_state(key, state)``: the state
  ``torch.optim`` keeps for the key's value (Adam's ``step``, ``exp_avg``,
  ``exp_avg_sq``), as a single-process optimizer keeps it for one parameter;
  copies both ways. Setting goes through the optimizer's own
  ``load_state_dict`` (tensors cast to the value's dtype as it does); a tensor
  entry shaped unlike the value is a ``ShapeMismatchError``, nothing changed.
- ``state_dict()`` holds copies of the values, each key's optimizer spec and
  optimizer state;
  ``load_state_dict()`` checks everything before changing anything.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradhub.errors import (
    DuplicateParameterError,
    InvalidOptionError,
    OptimizerMismatchError,
    ShapeMismatchError,
    UnknownParameterError,
    WrongTypeError,
)
from gradhub.optim import OptimizerFactory, OptimizerSpec, from_wire
from gradhub.ps.base import check_like
from gradhub.trees import PYTHON_CHECKED

__all__ = ["OptimizerFactory", "ParameterStore", "describe", "same_optimizer"]


def describe(spec: OptimizerSpec | None) -> str:
    """``SGD(lr=0.1, momentum=0.9, ...)``: class and hyperparameters, for messages."""
    if spec is None:
        return "no optimizer (a push replaces the value with the pushed sum)"
    hyper = ", ".join(f"{k}={v!r}" for k, v in spec.groups[0].items())
    return f"{spec.name}({hyper})"


def same_optimizer(a: OptimizerSpec, b: OptimizerSpec) -> bool:
    """Same class and same constructor hyperparameters (keys a scheduler adds,
    such as ``initial_lr``, do not count)."""
    if a.name != b.name:
        return False
    accepted = set(inspect.signature(a.cls.__init__).parameters) - {"self", "params"}
    ga, gb = a.groups[0], b.groups[0]
    return all(ga.get(k) == gb.get(k) for k in accepted if k in ga or k in gb)


def check_servable(spec: OptimizerSpec) -> OptimizerSpec:
    """``spec`` if a server can step it on a gradient alone (LBFGS needs a closure)."""
    if spec.name == "LBFGS":
        raise InvalidOptionError(
            "optimizer LBFGS re-evaluates the loss through a closure, which a parameter "
            "server does not have; use a gradient-only torch.optim optimizer (SGD, Adam, ...)"
        )
    return spec


def _spec_of(optimizer: OptimizerFactory | OptimizerSpec | None) -> OptimizerSpec | None:
    """The spec of a store's optimizer (a factory is probed once); ``None`` if it has none."""
    if optimizer is None or isinstance(optimizer, OptimizerSpec):
        return optimizer
    try:
        return OptimizerSpec.of(optimizer([torch.zeros(1, requires_grad=True)]))
    except TypeError:
        return None  # a factory of a class outside torch.optim: compared by identity only


def _plain_sgd(optimizer: torch.optim.Optimizer, value: torch.Tensor) -> bool:
    """Whether ``optimizer`` is SGD whose step on CPU is ``value.add_(grad, alpha=-lr)``
    alone (no momentum, weight decay, maximize, hooks; a float lr): then ``apply``
    runs that one operation itself, the same bits without the ~30 us of
    ``Optimizer.step``'s machinery, which was a third of a small push's CPU on
    the server (SGD is the default optimizer)."""
    if type(optimizer) is not torch.optim.SGD or not value.is_cpu:
        return False
    group = optimizer.param_groups[0]
    return (
        group["momentum"] == 0
        and group["weight_decay"] == 0
        and not group["maximize"]
        and not group.get("differentiable")
        and not group.get("fused")
        and isinstance(group["lr"], float | int)
        and not optimizer._optimizer_step_pre_hooks
        and not optimizer._optimizer_step_post_hooks
    )


_FORMATS = {torch.float32: "f", torch.float64: "d"}  # memoryview's, for small_grad


@dataclass(slots=True)
class _Scratch:
    """The tensor :meth:`ParameterStore.small_grad` fills for one key."""

    value: torch.Tensor  # the stored value it was made for
    dtype: torch.dtype
    shape: tuple[int, ...]
    tensor: torch.Tensor
    raw: memoryview  # the tensor's bytes, written in place
    items: memoryview  # its elements, read to check them


def _keeps_no_grad(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether an update by ``optimizer`` leaves no reference to the gradient it was
    given: none (a copy), or one of torch's own optimizers."""
    return optimizer is None or type(optimizer).__module__.startswith("torch.optim")


def _hyper_value(value: Any) -> Any:
    return from_wire(value)  # JSON lists, at any depth, to tuples: Adam's betas


class ParameterStore:
    """Values and per-key optimizers, with one-step-per-push apply."""

    def __init__(
        self,
        optimizer: OptimizerFactory | OptimizerSpec | None = None,
        *,
        fixed: bool | None = None,
    ) -> None:
        self._default = optimizer
        self.fixed = optimizer is not None if fixed is None else fixed
        self._values: dict[str, torch.Tensor] = {}
        self._optimizers: dict[str, torch.optim.Optimizer] = {}
        self._specs: dict[str, OptimizerSpec | None] = {}  # from init, for checkpoints
        self._steps: dict[str, int] = {}
        self._scratch: dict[str, _Scratch] = {}
        self._plain: dict[str, bool] = {}  # plain_update's answers, until a setting changes

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._values))

    def keys(self) -> Iterator[str]:
        return iter(self)

    def value(self, key: str) -> torch.Tensor:
        """The stored tensor itself (not a copy); ``UnknownParameterError`` if absent."""
        try:
            return self._values[key]
        except KeyError:
            raise UnknownParameterError(
                f"unknown parameter key {key!r}; call init({key!r}, ...) first"
            ) from None

    def steps(self, key: str) -> int:
        """How many pushes have been applied to ``key``."""
        self.value(key)
        return self._steps[key]

    def optimizer(self, key: str) -> torch.optim.Optimizer | None:
        self.value(key)
        return self._optimizers.get(key)

    def check(self, key: str, tensor: torch.Tensor) -> None:
        """Raise if ``key`` is unknown or ``tensor`` differs from it in shape or dtype."""
        check_like(key, self.value(key), tensor)

    def small_grad(
        self, key: str, dtype: torch.dtype | None, shape: tuple[int, ...], data: Any
    ) -> torch.Tensor | None:
        """``data``, the bytes of a small gradient of ``key`` (of ``dtype`` and
        ``shape``), in a tensor this store keeps for ``key`` and fills in place:
        no tensor made per push, for the next :meth:`apply` alone (it is
        overwritten by the next call). ``None``, nothing done, where the general
        path must decide: an unknown key, a dtype or shape unlike the value's,
        other than float32 and float64, more than 64 elements, an element NaN or
        infinite, or an optimizer not torch's own (it might keep the gradient)."""
        value = self._values.get(key)
        s = self._scratch.get(key)
        if s is None or s.value is not value:
            self._scratch.pop(key, None)
            if value is None:
                return None
            s = self._scratch_for(key, value)
            if s is None:
                return None
            self._scratch[key] = s
        if dtype is not s.dtype or shape != s.shape:
            return None
        try:
            s.raw[:] = data
        except (TypeError, ValueError):  # not a flat byte buffer of the value's size
            return None
        if not all(map(math.isfinite, s.items)):
            return None
        return s.tensor

    def plain_update(self, key: str) -> bool:
        """Whether :meth:`apply` of ``key`` is one ``add_`` (plain SGD) or ``copy_``
        (no optimizer): it cannot fail for a gradient :meth:`small_grad` gave. Kept
        per key until this store changes its optimizer's settings (the optimizers
        never leave the store)."""
        plain = self._plain.get(key)
        if plain is None:
            value, optimizer = self._values[key], self._optimizers.get(key)
            plain = not value.requires_grad and (optimizer is None or _plain_sgd(optimizer, value))
            self._plain[key] = plain
        return plain

    def _scratch_for(self, key: str, value: torch.Tensor) -> _Scratch | None:
        fmt = _FORMATS.get(value.dtype)
        if (
            fmt is None
            or value.numel() > PYTHON_CHECKED
            or not _keeps_no_grad(self._optimizers.get(key))
        ):
            return None
        tensor = torch.empty_like(value, memory_format=torch.contiguous_format)
        raw = memoryview(tensor.numpy()).cast("B")  # type: ignore[arg-type]
        items = raw.cast(fmt)  # type: ignore[call-overload]
        return _Scratch(value, value.dtype, tuple(value.shape), tensor, raw, items)

    def init(
        self, key: str, value: torch.Tensor, *, optimizer: OptimizerSpec | None = None
    ) -> None:
        """Store a copy of ``value`` under ``key``; ``DuplicateParameterError`` if present.

        ``optimizer``: the spec the caller wants for this key (one group). A
        fixed store refuses a different one (``OptimizerMismatchError``); an
        unfixed store builds it instead of its default.
        """
        if not isinstance(key, str) or not key:
            raise WrongTypeError(f"parameter keys are non-empty strings, got {key!r}")
        if key in self._values:
            raise DuplicateParameterError(
                f"parameter {key!r} is already initialised; each key is initialised once"
            )
        factory = self._factory_for(key, optimizer)
        stored = value.detach().clone()
        built = factory([stored]) if factory is not None else None
        self._values[key] = stored
        self._steps[key] = 0
        self._specs[key] = optimizer
        if built is not None:
            self._optimizers[key] = built

    def _factory_for(self, key: str, spec: OptimizerSpec | None) -> OptimizerFactory | None:
        default = self._default
        if spec is not None:
            check_servable(spec)
        if spec is None or not self.fixed:
            chosen = spec if spec is not None else default
            return chosen.factory() if isinstance(chosen, OptimizerSpec) else chosen
        mine = _spec_of(default)
        if mine is None or not same_optimizer(mine, spec):
            theirs = describe(spec)
            ours = describe(mine) if mine is not None or default is None else repr(default)
            raise OptimizerMismatchError(
                f"init of {key!r} asks for {theirs}, but this parameter server is fixed to "
                f"{ours}\n- help: use the server's optimizer, or start the server without "
                "an explicit optimizer so that it takes the workers' spec"
            )
        return default.factory() if isinstance(default, OptimizerSpec) else default

    @property
    def default_spec(self) -> OptimizerSpec | None:
        """The spec of the store's own optimizer (``None``: none, or not a torch.optim one)."""
        return _spec_of(self._default)

    def spec(self, key: str) -> OptimizerSpec | None:
        """The spec of ``key``'s optimizer (``None``: it has none)."""
        optimizer = self.optimizer(key)
        return None if optimizer is None else OptimizerSpec.of(optimizer)

    def set_hyperparameters(self, key: str, hyperparameters: Mapping[str, Any]) -> None:
        """Set hyperparameters (``lr``, ...) on ``key``'s param group; all checked first."""
        self._plain.pop(key, None)
        optimizer = self.optimizer(key)
        if optimizer is None:
            raise InvalidOptionError(
                f"{key!r} has no optimizer on this server to set {dict(hyperparameters)} on\n"
                "- help: give the key an optimizer at init (optimizer=OptimizerSpec.of(...)), "
                "or the server one"
            )
        group = optimizer.param_groups[0]
        unknown = sorted(set(hyperparameters) - set(group) - {"params"})
        if unknown or "params" in hyperparameters:
            has = ", ".join(k for k in group if k != "params")
            raise InvalidOptionError(
                f"{type(optimizer).__name__} of {key!r} has no hyperparameter(s) "
                f"{', '.join(unknown or ['params'])}; it has {has}"
            )
        group.update({k: _hyper_value(v) for k, v in hyperparameters.items()})

    def apply(
        self, key: str, grad: torch.Tensor, hyperparameters: Mapping[str, Any] | None = None
    ) -> None:
        """One update of ``key`` with ``grad`` (already summed over replicas), after
        setting ``hyperparameters`` on its optimizer."""
        value = self.value(key)
        if hyperparameters:
            self.set_hyperparameters(key, hyperparameters)
        optimizer = self._optimizers.get(key)
        if optimizer is not None and not grad.requires_grad and self.plain_update(key):
            # No autograd involved (neither requires grad), so no no_grad() needed.
            lr = optimizer.param_groups[0]["lr"]
            value.add_(grad if grad.dtype == value.dtype else grad.to(value.dtype), alpha=-lr)
            self._steps[key] += 1
            return
        with torch.no_grad():
            if optimizer is None:
                value.copy_(grad)
            elif _plain_sgd(optimizer, value):
                value.add_(grad.to(dtype=value.dtype), alpha=-optimizer.param_groups[0]["lr"])
            else:
                value.grad = grad.to(device=value.device, dtype=value.dtype)
                try:
                    optimizer.step()
                finally:
                    value.grad = None
        self._steps[key] += 1

    def _optimizer_of(self, key: str) -> torch.optim.Optimizer:
        optimizer = self.optimizer(key)
        if optimizer is None:
            raise InvalidOptionError(
                f"{key!r} has no optimizer on this server (a push replaces its value), "
                "so it has no optimizer state\n- help: give the key an optimizer at init "
                "(optimizer=OptimizerSpec.of(...)), or the server one"
            )
        return optimizer

    def optimizer_state(self, key: str) -> dict[str, Any]:
        """A copy of the state of ``key``'s optimizer (``{}`` before its first update)."""
        optimizer = self._optimizer_of(key)
        state = optimizer.state.get(self._values[key], {})
        return {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in state.items()
        }

    def set_optimizer_state(self, key: str, state: Mapping[str, Any]) -> None:
        """Replace the state of ``key``'s optimizer by a copy of ``state``."""
        self._plain.pop(key, None)
        optimizer = self._optimizer_of(key)
        value = self._values[key]
        for name, v in state.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape != value.shape:
                raise ShapeMismatchError(
                    f"[{key!r}][{name!r}]", list(value.shape), list(v.shape), "shape"
                )
        group = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        copied = {
            k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
            for k, v in state.items()
        }
        optimizer.load_state_dict(
            {"state": {0: copied} if copied else {}, "param_groups": [{**group, "params": [0]}]}
        )

    def copy_into(self, key: str, targets: Sequence[torch.Tensor]) -> None:
        """Copy the value of ``key`` into every tensor of ``targets`` in place."""
        value = self.value(key)
        with torch.no_grad():
            for t in targets:
                t.copy_(value)

    def state_dict(self) -> dict[str, Any]:
        """Copies of every value, optimizer state and step count."""
        return {
            "values": {k: v.detach().clone() for k, v in self._values.items()},
            "optimizers": {k: copy.deepcopy(o.state_dict()) for k, o in self._optimizers.items()},
            "specs": {k: None if s is None else s.to_dict() for k, s in self._specs.items()},
            "steps": dict(self._steps),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore values and optimizer state saved by :meth:`state_dict`.

        Keys not yet present are initialised; present keys must match in shape
        and dtype. Everything is checked before anything changes.
        """
        self._plain.clear()  # optimizers' settings come from the checkpoint
        values: dict[str, torch.Tensor] = state["values"]
        optimizers: dict[str, Any] = state.get("optimizers", {})
        for key, v in values.items():
            if key in self._values:
                check_like(key, self._values[key], v)
        specs = {
            k: None if d is None else OptimizerSpec.from_dict(d)
            for k, d in state.get("specs", {}).items()
        }
        for key in optimizers:
            if key not in values:
                raise InvalidOptionError(
                    f"optimizer state for {key!r} has no value in the checkpoint\n- help: "
                    "the file is not a whole checkpoint of a server; use another --checkpoint-dir"
                )
            if key in self._values:
                has = key in self._optimizers
            else:
                has = self._factory_for(key, specs.get(key)) is not None
            if not has:
                raise InvalidOptionError(
                    f"the checkpoint holds optimizer state for {key!r}, which has none here\n"
                    "- help: start the server with the optimizer it had when it wrote the "
                    "checkpoint (--optimizer), or use another --checkpoint-dir"
                )
        for key, v in values.items():
            if key in self._values:
                with torch.no_grad():
                    self._values[key].copy_(v)
            else:
                self.init(key, v, optimizer=specs.get(key))
            if key in optimizers:
                self._optimizers[key].load_state_dict(copy.deepcopy(optimizers[key]))
            self._steps[key] = int(state.get("steps", {}).get(key, 0))
