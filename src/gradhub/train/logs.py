"""Logging with the rank in every line.

The library logs through :mod:`logging` only. :func:`rank_logger` wraps a
module's logger so each message starts with ``[rank N]``; the CLI (or the
user) configures handlers and levels.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # subscriptable at run time only from Python 3.11
    _Adapter = logging.LoggerAdapter[logging.Logger]
else:
    _Adapter = logging.LoggerAdapter


class RankLogger(_Adapter):
    """A logger adapter that prefixes every message with ``[rank N]``."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        return f"[rank {self.extra['rank'] if self.extra else '?'}] {msg}", kwargs


def rank_logger(name: str, rank: int) -> RankLogger:
    """The logger ``name`` with ``[rank N]`` in front of each message."""
    return RankLogger(logging.getLogger(name), {"rank": rank})
