"""What every part of a strategy stands on: the runtime the strategy was set up with.

:class:`~gradhub.train.strategies.base.Strategy` is built from parts, one
module each: the loss scaling (:mod:`.scaling`), the forward side of DDP's
surface (:mod:`.forward`) and survival (:mod:`.survival`). Each part is a
:class:`StrategyPart`, so it reaches the runtime as the strategy does
(refused before ``setup`` and after ``close``); what else a part needs of the
strategy it is part of, each part lists as annotations at the top of its class.
"""

from __future__ import annotations

from typing import Any, ClassVar

from gradhub.errors import ClosedError, StateError
from gradhub.runtime import Runtime


class StrategyPart:
    """The runtime of a strategy, for the strategy and each of its parts.

    What it needs of the strategy: its name and its step count (both named in
    errors).
    """

    name: ClassVar[str]
    steps: int

    _runtime: Runtime | None = None
    """Set by :meth:`~gradhub.train.strategies.base.Strategy.setup`."""
    _closed = False
    """Set by :meth:`~gradhub.train.strategies.base.Strategy.close`."""

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

    def _wait(self, work: Any, operation: str) -> None:
        """Bounded wait on a c10d work item; failures name the rank(s) responsible."""
        self.runtime.wait(work, operation, where=f"step {self.steps} of strategy {self.name!r}")
