"""What a bucket reducer is (the contract is :mod:`gradhub.train.reducers`'s
docstring) and the handles its ``launch`` may return besides a c10d ``Work``."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class BucketReducer(Protocol):
    """Sums a flat gradient bucket over the ranks in place (see the package contract)."""

    def reduce(
        self, bucket: torch.Tensor, *, shapes: list[torch.Size], bucket_index: int, step: int
    ) -> None: ...


ReducerFactory = Callable[..., BucketReducer]
"""Builds a reducer; called with ``group=`` (the process group) and the options."""


class StreamWork:
    """A device collective waited as DDP waits for one: ``wait`` makes the
    current stream wait for it and returns at once (no host synchronisation).

    Its bound is the process group's own timeout: NCCL's watchdog ends a
    collective that outlives it (and, by default, the process), so a dead or
    stalled peer never hangs the job.
    """

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._work.wait()
        return True


class Ready:
    """A reduction with nothing to wait for."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True
