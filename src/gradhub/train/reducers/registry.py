"""The bucket reducers by name: what ``compress=`` of the ``allreduce``
strategy accepts, the built-ins and what :func:`register` adds.

:data:`_REDUCERS` is the one piece of module-level state of the ``compress=``
vocabulary, as a plug-in registry is: :func:`register` adds to it for the life
of the process (a test that registers a name swaps in a copy). The check of a
name is the vocabulary's one check, :func:`gradhub.codecs.check`, given these
names, so an unknown name gets the same message as at every other
``compress=``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradhub import codecs
from gradhub.collective import CollectiveGroup
from gradhub.errors import InvalidOptionError, WrongTypeError
from gradhub.train.reducers.allreduce import AllReduce, HalfAllReduce
from gradhub.train.reducers.base import BucketReducer, ReducerFactory
from gradhub.train.reducers.powersgd import PowerSGD

_BUILT_IN: dict[str, ReducerFactory] = {
    "none": AllReduce,
    "fp16": lambda **kw: HalfAllReduce(torch.float16, **kw),
    "bf16": lambda **kw: HalfAllReduce(torch.bfloat16, **kw),
    "powersgd": PowerSGD,
}
"""The built-in reducers: they take ``collective=`` and reduce on its transport."""

_REDUCERS: dict[str, ReducerFactory] = dict(_BUILT_IN)
"""Reducer factories by name: the built-ins, then what :func:`register` adds."""


def register(name: str, factory: ReducerFactory) -> None:
    """Make ``compress=name`` build reducers with ``factory(group=..., **options)``
    (added to the one ``compress=`` vocabulary, :func:`gradhub.codecs.check`)."""
    if not isinstance(name, str) or not name:
        raise InvalidOptionError(f"a bucket reducer name is a non-empty str, got {name!r}")
    if name in _REDUCERS:
        raise InvalidOptionError(f"a bucket reducer called {name!r} is already registered")
    _REDUCERS[name] = factory


def available() -> list[str]:
    """The names the ``allreduce`` strategy's ``compress=`` accepts, sorted."""
    return sorted(_REDUCERS)


def check_name(name: str) -> None:
    """``ValueError`` listing the known reducers if ``name`` is not one
    (:func:`gradhub.codecs.check` for the ``allreduce`` strategy)."""
    codecs.check(name, for_="allreduce", reducers=available())


def make(
    name: str,
    *,
    group: dist.ProcessGroup | None = None,
    collective: CollectiveGroup | None = None,
    **options: Any,
) -> BucketReducer:
    """The reducer called ``name`` over ``group`` (default: the default group).

    ``collective``: a :class:`~gradhub.collective.CollectiveGroup` of the same
    ranks; the built-in reducers then reduce on its transport (see the package
    docstring). Reducers added with :func:`register` are built with
    ``group=`` and their options only.
    """
    check_name(name)
    if collective is not None and name in _BUILT_IN:
        options["collective"] = collective
    reducer = _REDUCERS[name](group=group, **options)
    if not isinstance(reducer, BucketReducer):
        raise WrongTypeError(f"the factory of {name!r} returned {reducer!r}, which has no reduce()")
    return reducer
