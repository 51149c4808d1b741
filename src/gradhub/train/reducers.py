"""Bucket reducers: how the ``allreduce`` strategy sums one gradient bucket.

The extension point of ``allreduce``'s communication, like DDP's comm hooks.
A reducer is any object with

.. code-block:: python

    def reduce(self, bucket: torch.Tensor, *, shapes: list[torch.Size],
               bucket_index: int, step: int) -> None: ...

Contract:

- ``bucket`` is a flat, contiguous float32 tensor: the gradients of the
  tensors whose shapes are ``shapes``, back to back, each already multiplied
  by this rank's weight (its share of the batch), so the **sum** over the
  ranks is the gradient wanted. Elements after the last tensor of ``shapes``
  (the sample count rides there in bucket 0) must be summed exactly.
- ``reduce`` replaces ``bucket`` in place by that sum (or an approximation of
  it) and returns when it is there. **Every rank must end with the same
  bits**: replicas stay equal only if they apply the same update.
- ``bucket_index`` is stable from step to step (the same layout under the
  same index), so a reducer may keep per-bucket state (error feedback);
  ``step`` counts optimizer steps from 0. Buckets are reduced one at a
  time, in index order, on one thread, the same order on every rank.
- A reducer may also offer ``launch(bucket, *, shapes, bucket_index, step)``
  returning a handle with ``wait(timeout: timedelta)`` (a c10d ``Work`` is
  one) to start the reduction without a thread; the strategy then calls it
  from the backward hooks instead of running ``reduce`` on its thread.

- A reducer that keeps state from step to step may offer ``step_skipped()``:
  called on every rank when a loss scaler skipped the step just reduced (its
  gradients held inf or NaN), so that state is not poisoned for later steps.

``compress=`` of the ``allreduce`` strategy picks one by name from
:func:`available`: ``"none"`` (a plain fp32 all-reduce), ``"fp16"`` and
``"bf16"`` (the bucket is rounded to 16 bits, summed in 16 bits, and widened
back: every rank receives the same 16-bit sum, hence the same bits; as DDP's
``fp16_compress_hook``). :func:`register` adds a name (``"powersgd"``).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gradhub.collective import CollectiveGroup, all_reduce


@runtime_checkable
class BucketReducer(Protocol):
    """Sums a flat gradient bucket over the ranks in place (see the module contract)."""

    def reduce(
        self, bucket: torch.Tensor, *, shapes: list[torch.Size], bucket_index: int, step: int
    ) -> None: ...


class _Widen:
    """Handle of a 16-bit all-reduce: waits, then copies the sum back into fp32."""

    def __init__(self, work: Any, wire: torch.Tensor, bucket: torch.Tensor) -> None:
        self._work, self._wire, self._bucket = work, wire, bucket

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is None:
            self._work.wait()
        else:
            self._work.wait(timeout=timeout)
        self._bucket.copy_(self._wire)
        return True


class AllReduce:
    """``compress="none"``: one fp32 all-reduce (sum) of the bucket.

    With ``collective=`` (a :class:`~gradhub.collective.CollectiveGroup`, as the
    ``allreduce`` strategy passes) it is :func:`gradhub.collective.all_reduce`
    on that group's transport: shared memory when every rank is on one host,
    the ring otherwise. Else gloo's (or NCCL's) own ``all_reduce``.
    """

    name = "none"

    def __init__(
        self, *, group: dist.ProcessGroup | None = None, collective: CollectiveGroup | None = None
    ) -> None:
        self.group = group
        self.collective = collective

    def launch(
        self, bucket: torch.Tensor, *, shapes: list[torch.Size], bucket_index: int, step: int
    ) -> Any:
        if self.collective is not None:
            return all_reduce(bucket, group=self.collective)
        return dist.all_reduce(bucket, group=self.group, async_op=True)

    def reduce(
        self, bucket: torch.Tensor, *, shapes: list[torch.Size], bucket_index: int, step: int
    ) -> None:
        self.launch(bucket, shapes=shapes, bucket_index=bucket_index, step=step).wait()


class HalfAllReduce(AllReduce):
    """``compress="fp16"`` / ``"bf16"``: the bucket travels and is summed in 16 bits.

    The sample count at the end of bucket 0 is an integer below 2**11, exact
    in both formats. fp16 overflows above 65504: the gradients are already
    divided by the number of ranks (scaled before the reduction), which is the
    scaling DDP's ``fp16_compress_hook`` relies on too.
    """

    def __init__(self, dtype: torch.dtype, *, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(group=group)  # gloo's all_reduce in 16 bits, never the transport
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"

    def launch(
        self, bucket: torch.Tensor, *, shapes: list[torch.Size], bucket_index: int, step: int
    ) -> Any:
        wire = bucket.to(self.dtype)
        return _Widen(dist.all_reduce(wire, group=self.group, async_op=True), wire, bucket)


def _powersgd(**options: Any) -> BucketReducer:
    """``compress="powersgd"``: :class:`gradhub.powersgd.PowerSGD` (imported on use)."""
    from gradhub.powersgd import PowerSGD

    return PowerSGD(**options)


ReducerFactory = Callable[..., BucketReducer]
"""Builds a reducer; called with ``group=`` (the process group) and the options."""

_REGISTRY: dict[str, ReducerFactory] = {
    "none": AllReduce,
    "fp16": lambda **kw: HalfAllReduce(torch.float16, **kw),
    "bf16": lambda **kw: HalfAllReduce(torch.bfloat16, **kw),
    "powersgd": lambda **kw: _powersgd(**kw),
}


def register(name: str, factory: ReducerFactory) -> None:
    """Make ``compress=name`` build reducers with ``factory(group=..., **options)``."""
    if name in _REGISTRY:
        raise ValueError(f"a bucket reducer called {name!r} is already registered")
    _REGISTRY[name] = factory


def available() -> list[str]:
    """The names ``compress=`` accepts."""
    return sorted(_REGISTRY)


def check_name(name: str) -> None:
    """``ValueError`` listing the known reducers if ``name`` is not one."""
    if name not in _REGISTRY:
        raise ValueError(
            f"unknown compress={name!r} for strategy 'allreduce'\n"
            f"- help: choose one of {', '.join(available())}"
        )


def make(name: str, *, group: dist.ProcessGroup | None = None, **options: Any) -> BucketReducer:
    """The reducer called ``name`` over ``group`` (default: the default group)."""
    check_name(name)
    reducer = _REGISTRY[name](group=group, **options)
    if not isinstance(reducer, BucketReducer):
        raise TypeError(f"the factory of {name!r} returned {reducer!r}, which has no reduce()")
    return reducer
