"""Training strategies: one small interface (:mod:`.base`), one module each.

``make_strategy(name, **options)`` builds one by name; an unknown name is a
``ValueError`` listing the known ones, raised before any process group work.
"""

from __future__ import annotations

import importlib
from typing import Any

from gradhub.errors import InvalidOptionError
from gradhub.train.strategies.base import Closure, Strategy

# name -> (module, class); modules are imported on use so that, e.g., the
# parameter-server client is only loaded by jobs that use it.
_REGISTRY: dict[str, tuple[str, str]] = {
    "allreduce": ("gradhub.train.strategies.allreduce", "AllReduceStrategy"),
    "diloco": ("gradhub.train.strategies.diloco", "DiLoCoStrategy"),
    "ps-async": ("gradhub.train.strategies.ps", "AsyncPSStrategy"),
    "ps-ssp": ("gradhub.train.strategies.ps", "SSPPSStrategy"),
    "ps-sync": ("gradhub.train.strategies.ps", "SyncPSStrategy"),
    "sharded": ("gradhub.train.strategies.sharded", "ShardedStrategy"),
}


def available() -> list[str]:
    """The strategy names ``make_strategy`` accepts."""
    return sorted(_REGISTRY)


def check_name(name: str) -> None:
    """Raise a ``ValueError`` naming the known strategies if ``name`` is not one."""
    if name not in _REGISTRY:
        raise InvalidOptionError(
            f"unknown strategy {name!r}\n- help: choose one of {', '.join(available())}"
        )


def make_strategy(name: str, **options: Any) -> Strategy:
    """Build the strategy called ``name`` with its keyword ``options``."""
    check_name(name)
    module, cls = _REGISTRY[name]
    strategy: Strategy = getattr(importlib.import_module(module), cls)(**options)
    return strategy


__all__ = ["Closure", "Strategy", "available", "check_name", "make_strategy"]
