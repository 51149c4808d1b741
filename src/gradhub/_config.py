"""Typed configurations, given either whole (``config=``) or as keyword options."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from gradhub.errors import UnsupportedOptionError

C = TypeVar("C")


def config_or_options(cls: type[C], config: C | None, options: Mapping[str, Any]) -> C:
    """``config`` when given, else ``cls(**options)`` (which validates them).

    Both at once is a ``TypeError``: one source for each setting.
    """
    if config is not None and options:
        raise UnsupportedOptionError("pass either config= or keyword options, not both")
    return config if config is not None else cls(**options)
