"""DDP's comm hooks (``model.register_comm_hook(state, hook)``) under the
``allreduce`` strategy: the hook gets a :class:`GradBucket` (DDP's interface)
holding raw gradients and returns a ``torch.futures.Future`` of the summed
bucket, which :class:`CommHook` waits for (bounded) and puts in place."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradhub.errors import WrongTypeError


class GradBucket:
    """DDP's ``GradBucket`` interface over one bucket, for a comm hook."""

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        params: list[torch.nn.Parameter],
        offsets: list[int],
        is_last: bool,
    ) -> None:
        self._index, self._buffer, self._params = index, buffer, params
        self._offsets, self._is_last = offsets, is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer.copy_(buffer)

    def gradients(self) -> list[torch.Tensor]:
        b = self._buffer
        return [
            b[o : o + p.numel()].view_as(p)
            for p, o in zip(self._params, self._offsets, strict=True)
        ]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._params)

    def is_last(self) -> bool:
        return self._is_last


class CommHook:
    """Runs a DDP comm hook ``hook(state, bucket) -> Future[Tensor]`` on a bucket."""

    def __init__(self, state: object, hook: Callable[..., Any]) -> None:
        if not callable(hook):
            raise WrongTypeError(
                f"a comm hook is a callable (state, bucket) -> Future, got {hook!r}"
            )
        self.state, self.hook = state, hook

    def launch(self, bucket: GradBucket, tail: torch.Tensor | None) -> Any:
        """Start the hook; ``tail`` (used flags, count) is summed by a plain all-reduce."""
        future = self.hook(self.state, bucket)
        if not isinstance(future, torch._C.Future):
            raise WrongTypeError(
                f"the comm hook returned {type(future).__name__}, not a torch.futures.Future"
                "\n- help: return the future of an async collective, as DDP's hooks do"
            )
        return _HookWork(future, bucket.buffer(), tail)


class _HookWork:
    """Waits for a comm hook's future (bounded), then puts its tensor in the bucket.

    The tail's all-reduce starts only once the hook's future is done: a hook
    may chain collectives from its future's callbacks (PowerSGD does), and
    starting ours meanwhile would order the collectives differently on
    different ranks.
    """

    def __init__(self, future: Any, buffer: torch.Tensor, tail: torch.Tensor | None) -> None:
        self._future, self._buffer, self._tail = future, buffer, tail
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self._done.wait(seconds):
            return False
        value = self._future.value()  # raises the hook's error
        tensor = value[0] if isinstance(value, (list, tuple)) else value
        if tensor.data_ptr() != self._buffer.data_ptr():
            self._buffer.copy_(tensor.reshape(-1))
        if self._tail is not None:
            work = dist.all_reduce(self._tail, async_op=True)
            return bool(work.wait(timeout) if timeout is not None else work.wait())
        return True
