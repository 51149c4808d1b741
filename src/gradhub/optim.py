"""One optimizer representation for every strategy and server: :class:`OptimizerSpec`.

A spec is a ``torch.optim`` class name plus the hyperparameters of each
parameter group, nothing else, so it can be built anywhere: over a local
model, over one rank's slice (``sharded``), or on a parameter server for one
key (``ps-*``), and sent there as plain JSON.

.. code-block:: python

    spec = OptimizerSpec.of(torch.optim.AdamW(model.parameters(), lr=3e-4))  # from an instance
    spec = OptimizerSpec.of(torch.optim.SGD, lr=0.1, momentum=0.9)          # from a class
    spec = OptimizerSpec.of("sgd", lr=0.1)                                   # from a name
    opt = spec.build([slice_tensor])              # one group: group 0's hyperparameters
    opt = spec.build([[w1, b1], [w2, b2]])        # one list per group
    OptimizerSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec

Decisions:

- Only the optimizers of ``torch.optim`` itself are accepted: a subclass or
  a class of another package cannot be rebuilt by name on a server, so it is
  a ``TypeError`` that says so and what to do (use a ``torch.optim`` class, or
  a strategy that steps the local optimizer).
- A group's hyperparameters are every key of its ``param_group`` except
  ``params``; keys the constructor does not take (``initial_lr`` added by an LR
  scheduler) are set on the group after construction, so a scheduler created
  before the spec was taken still works on the rebuilt optimizer.
- Hyperparameters must be JSON values (numbers, booleans, strings, None and
  lists/tuples of them, nested too); a one-element tensor (a tensor learning
  rate, a tensor in Adam's ``betas``) is converted with ``float``: a server
  and a shard hold it as a Python number. Every list comes back as a tuple
  (Adam's ``betas``, Rprop's ``etas``, Adafactor's ``eps``), at any depth.
- :func:`wire_hyperparameters` is the one conversion, used for a spec and
  for the hyperparameters a ``ps-*`` worker sends with a push when the
  script changed them mid-run (any type above, not only numbers), and
  :func:`from_wire` the one way back (JSON lists to tuples).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradhub.errors import (
    InvalidOptionError,
    UnsupportedByStrategyError,
    UnsupportedOptionError,
    WrongTypeError,
)

OptimizerFactory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
"""A callable that builds an optimizer over a list of tensors."""

Hyperparameters = dict[str, Any]


@functools.cache
def _torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    """``torch.optim``'s optimizer classes by name (read once; callers do not modify it)."""
    found: dict[str, type[torch.optim.Optimizer]] = {}
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if (
            isinstance(cls, type)
            and issubclass(cls, torch.optim.Optimizer)
            and cls is not torch.optim.Optimizer
        ):
            found[name] = cls
    return found


def optimizer_class(name: str) -> type[torch.optim.Optimizer]:
    """The ``torch.optim`` class called ``name`` (case-insensitive: ``"adamw"`` works)."""
    if not isinstance(name, str):
        raise WrongTypeError(f"an optimizer name is a str, got {type(name).__name__}")
    known = _torch_optimizers()
    by_lower = {k.lower(): v for k, v in known.items()}
    cls = by_lower.get(name.lower())
    if cls is None:
        raise InvalidOptionError(
            f"unknown optimizer {name!r}; use a torch.optim class name: {', '.join(sorted(known))}"
        )
    return cls


def wire_value(key: str, value: Any) -> Any:
    """``value`` of hyperparameter ``key`` as a JSON value (see the module docstring)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise WrongTypeError(f"hyperparameter {key!r} is a tensor of {value.numel()} elements")
        return float(value.item())
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidOptionError(f"hyperparameter {key!r} is {value}; it must be finite")
        return value
    if isinstance(value, list | tuple):
        return tuple(wire_value(key, v) for v in value)
    raise WrongTypeError(
        f"hyperparameter {key!r} of type {type(value).__name__} cannot be sent to a server; "
        "use numbers, booleans, strings or tuples of them"
    )


def wire_hyperparameters(group: Mapping[str, Any]) -> Hyperparameters:
    """Every hyperparameter of a ``param_group`` (all keys but ``params``) as JSON values."""
    return {k: wire_value(k, v) for k, v in group.items() if k != "params"}


def from_wire(value: Any) -> Any:
    """A hyperparameter read back from JSON: lists become tuples, at any depth."""
    if isinstance(value, list | tuple):
        return tuple(from_wire(v) for v in value)
    return value


@dataclass(frozen=True)
class OptimizerSpec:
    """A ``torch.optim`` class name and the hyperparameters of each parameter group."""

    name: str
    """The class name in ``torch.optim`` (``"SGD"``, ``"AdamW"``, ...)."""

    groups: tuple[Hyperparameters, ...]
    """Hyperparameters per parameter group (at least one), without ``params``."""

    def __post_init__(self) -> None:
        cls = optimizer_class(self.name)
        object.__setattr__(self, "name", cls.__name__)
        if not self.groups:
            raise InvalidOptionError("an OptimizerSpec needs at least one parameter group")
        object.__setattr__(self, "groups", tuple(wire_hyperparameters(g) for g in self.groups))

    @classmethod
    def of(
        cls,
        optimizer: torch.optim.Optimizer | type[torch.optim.Optimizer] | str | OptimizerSpec,
        **hyperparameters: Any,
    ) -> OptimizerSpec:
        """The spec of an optimizer instance, or of a class or name with ``hyperparameters``.

        From a class or name, defaults the constructor has are filled in, so
        ``of("sgd", lr=0.1)`` equals ``of(torch.optim.SGD([t], lr=0.1))``.
        """
        if isinstance(optimizer, OptimizerSpec):
            if hyperparameters:
                raise UnsupportedOptionError(
                    "hyperparameters are given with a class or name, not a spec"
                )
            return optimizer
        if isinstance(optimizer, torch.optim.Optimizer):
            if hyperparameters:
                raise UnsupportedOptionError(
                    "hyperparameters are given with a class or name; an optimizer "
                    "instance carries its own"
                )
            _check_torch_class(type(optimizer))
            return cls(type(optimizer).__name__, tuple(optimizer.param_groups))
        if isinstance(optimizer, type):
            _check_torch_class(optimizer)
            optimizer = optimizer.__name__
        if not isinstance(optimizer, str):
            raise WrongTypeError(
                "an optimizer is a torch.optim.Optimizer instance, class or name, "
                f"got {type(optimizer).__name__}"
            )
        probe = torch.zeros(1, requires_grad=True)
        try:
            built = optimizer_class(optimizer)([probe], **hyperparameters)
        except TypeError as exc:
            raise UnsupportedOptionError(f"{optimizer}: {exc}") from exc
        return cls(type(built).__name__, tuple(built.param_groups))

    @property
    def cls(self) -> type[torch.optim.Optimizer]:
        """The ``torch.optim`` class."""
        return optimizer_class(self.name)

    def hyperparameters(self, group: int = 0) -> Hyperparameters:
        """A copy of group ``group``'s hyperparameters."""
        return dict(self.groups[group])

    def build(
        self, params: Sequence[torch.Tensor] | Sequence[Sequence[torch.Tensor]]
    ) -> torch.optim.Optimizer:
        """A fresh optimizer over ``params``.

        A flat list of tensors makes one group with group 0's hyperparameters;
        a list of lists makes one group per inner list, matched to the spec's
        groups by position (their counts must agree).
        """
        nested = bool(params) and not isinstance(params[0], torch.Tensor)
        lists: list[list[Any]] = [list(g) for g in params] if nested else [list(params)]
        if nested and len(lists) != len(self.groups):
            raise InvalidOptionError(
                f"{len(lists)} parameter groups given, the {self.name} spec has {len(self.groups)}"
            )
        accepted = set(inspect.signature(self.cls.__init__).parameters) - {"self", "params"}
        groups: list[dict[str, Any]] = []
        for tensors, hyper in zip(lists, self.groups, strict=False):
            group: dict[str, Any] = {"params": tensors}
            group.update({k: v for k, v in hyper.items() if k in accepted})
            groups.append(group)
        cls: Any = self.cls
        optimizer: torch.optim.Optimizer = cls(groups)
        for group, hyper in zip(optimizer.param_groups, self.groups, strict=False):
            group.update({k: v for k, v in hyper.items() if k not in accepted})
        return optimizer

    def factory(self, group: int = 0) -> OptimizerFactory:
        """A ``list[Tensor] -> Optimizer`` callable with group ``group``'s hyperparameters."""
        one = OptimizerSpec(self.name, (self.groups[group],))
        return one.build

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe form (tuples become lists); :meth:`from_dict` reverses it."""
        return {
            "name": self.name,
            "groups": [
                {k: list(v) if isinstance(v, tuple) else v for k, v in g.items()}
                for g in self.groups
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OptimizerSpec:
        """The spec :meth:`to_dict` wrote."""
        if not isinstance(data, Mapping) or set(data) != {"name", "groups"}:
            raise InvalidOptionError(
                f"an optimizer spec is {{'name': ..., 'groups': [...]}}, got {data!r}"
            )
        groups = tuple({k: from_wire(v) for k, v in dict(g).items()} for g in data["groups"])
        return cls(str(data["name"]), groups)


def _check_torch_class(cls: type) -> None:
    if (
        not issubclass(cls, torch.optim.Optimizer)
        or _torch_optimizers().get(cls.__name__) is not cls
    ):
        raise UnsupportedByStrategyError(
            f"{cls.__module__}.{cls.__qualname__} is not a torch.optim optimizer, so it cannot "
            "be rebuilt on a parameter server or over a shard\n- help: use a torch.optim class "
            "(SGD, Adam, AdamW, ...), or strategy='allreduce', which steps your own optimizer"
        )
