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
  ranks is the gradient wanted. Elements after the last tensor of ``shapes``,
  if a caller puts any there, must be summed exactly (the ``allreduce``
  strategy puts none: its flags and counts travel apart).
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
``"bf16"`` (16 bits on the wire), ``"powersgd"`` (:mod:`gradhub.powersgd`).
:func:`register` adds a name.

The strategy passes the job's :class:`~gradhub.collective.CollectiveGroup`
(``collective=``), and the built-in reducers then reduce through
:func:`gradhub.collective.all_reduce` on its transport: shared memory when
every rank is on one host, the hierarchical path (shared memory inside each
host, fp32; the ring between hosts) when the ranks span hosts that each hold
the same number of them, else the ring. Without one they call the backend's
own ``all_reduce`` on ``group=``.

What ``"fp16"`` / ``"bf16"`` mean:

- through the group: 16 bits on the wire, fp32 accumulation. Each rank's
  contribution is rounded to 16 bits (for buckets above 4 MB of wire on the
  ring's point-to-point path, and its shared-memory twin: each hop's partial
  sum, ``"fp16"`` divided by the number of ranks before and multiplied after),
  the sum is taken in fp32 and rounded to 16 bits once by the rank that owns
  the slice, and every rank decodes those 16-bit values: the same bits
  everywhere, and values that 16 bits can hold. Across hosts the host sums
  are fp32 and only the hop between hosts is 16-bit (see
  :mod:`gradhub.transports.hierarchical`);
- without it: the bucket is rounded to 16 bits and summed in 16 bits by the
  backend (gloo adds in half precision), as DDP's ``fp16_compress_hook``
  does; every rank receives the same 16-bit sum.

DDP's comm hooks (``model.register_comm_hook(state, hook)``, ``allreduce``
only) run through :class:`CommHook`: the hook gets a :class:`GradBucket`
(DDP's interface: ``index()``, ``buffer()``, ``gradients()``,
``parameters()``, ``is_last()``, ``set_buffer()``) holding raw gradients and
returns a ``torch.futures.Future`` of the summed bucket.

``"fp16"`` does not saturate either way: a contribution or sum beyond
+-65504 arrives as inf, which a loss scaler counts as found inf.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gradhub import codecs
from gradhub.collective import CollectiveGroup, all_reduce


@runtime_checkable
class BucketReducer(Protocol):
    """Sums a flat gradient bucket over the ranks in place (see the module contract)."""

    def reduce(
        self, bucket: torch.Tensor, *, shapes: list[torch.Size], bucket_index: int, step: int
    ) -> None: ...


def on_native_device(bucket: torch.Tensor, collective: CollectiveGroup) -> bool:
    """Whether ``bucket`` lives on a device whose collectives the process group
    runs itself (CUDA under NCCL): then the bucket goes to it straight from the
    backward hook, on the device's streams, as DDP's reducer does."""
    return bucket.device.type == "cuda" and "nccl" in collective.backend


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
        if self.collective is not None and not on_native_device(bucket, self.collective):
            if self.collective.world_size == 1:
                return Ready()  # the sum over one rank is the bucket itself
            return all_reduce(bucket, group=self.collective)
        group = self.collective.process_group if self.collective is not None else self.group
        work = dist.all_reduce(bucket, group=group, async_op=True)
        return StreamWork(work) if bucket.device.type != "cpu" else work

    def reduce(
        self, bucket: torch.Tensor, *, shapes: list[torch.Size], bucket_index: int, step: int
    ) -> None:
        self.launch(bucket, shapes=shapes, bucket_index=bucket_index, step=step).wait()


class HalfAllReduce(AllReduce):
    """``compress="fp16"`` / ``"bf16"``: the bucket travels in 16 bits.

    With ``collective=``: :func:`gradhub.collective.all_reduce` with the
    ``"bf16"`` codec, or a non-saturating ``"fp16"`` one, summed in fp32 (see
    the module docstring). Else the backend's ``all_reduce`` of a 16-bit copy,
    summed in 16 bits. fp16 overflows above 65504: the
    gradients are already divided by the number of ranks (scaled before the
    reduction), which is the scaling DDP's ``fp16_compress_hook`` relies on too.
    """

    def __init__(
        self,
        dtype: torch.dtype,
        *,
        group: dist.ProcessGroup | None = None,
        collective: CollectiveGroup | None = None,
    ) -> None:
        super().__init__(group=group, collective=collective)
        self.dtype = dtype
        self.name = "fp16" if dtype == torch.float16 else "bf16"
        self.codec: codecs.Codec = (
            codecs.FP16(saturate=False) if dtype == torch.float16 else codecs.BF16()
        )

    def launch(
        self, bucket: torch.Tensor, *, shapes: list[torch.Size], bucket_index: int, step: int
    ) -> Any:
        if self.collective is not None:
            return all_reduce(bucket, group=self.collective, compress=self.codec)
        wire = bucket.to(self.dtype)
        return _Widen(dist.all_reduce(wire, group=self.group, async_op=True), wire, bucket)


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
            raise TypeError(f"a comm hook is a callable (state, bucket) -> Future, got {hook!r}")
        self.state, self.hook = state, hook

    def launch(self, bucket: GradBucket, tail: torch.Tensor | None) -> Any:
        """Start the hook; ``tail`` (used flags, count) is summed by a plain all-reduce."""
        future = self.hook(self.state, bucket)
        if not isinstance(future, torch._C.Future):
            raise TypeError(
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


def _powersgd(**options: Any) -> BucketReducer:
    """``compress="powersgd"``: :class:`gradhub.powersgd.PowerSGD` (imported on use)."""
    from gradhub.powersgd import PowerSGD

    return PowerSGD(**options)


ReducerFactory = Callable[..., BucketReducer]
"""Builds a reducer; called with ``group=`` (the process group) and the options."""

_BUILT_IN: dict[str, ReducerFactory] = {
    "none": AllReduce,
    "fp16": lambda **kw: HalfAllReduce(torch.float16, **kw),
    "bf16": lambda **kw: HalfAllReduce(torch.bfloat16, **kw),
    "powersgd": lambda **kw: _powersgd(**kw),
}
"""The built-in reducers: they take ``collective=`` and reduce on its transport."""

for _name, _factory in _BUILT_IN.items():
    codecs.register_reducer(_name, _factory)


def register(name: str, factory: ReducerFactory) -> None:
    """Make ``compress=name`` build reducers with ``factory(group=..., **options)``
    (added to the one ``compress=`` vocabulary, :func:`gradhub.codecs.check`)."""
    codecs.register_reducer(name, factory)


def available() -> list[str]:
    """The names the ``allreduce`` strategy's ``compress=`` accepts."""
    return codecs.available(codecs.BUCKET)


def check_name(name: str) -> None:
    """``ValueError`` listing the known reducers if ``name`` is not one
    (:func:`gradhub.codecs.check` for the ``allreduce`` strategy)."""
    codecs.check(name, for_="allreduce")


def make(
    name: str,
    *,
    group: dist.ProcessGroup | None = None,
    collective: CollectiveGroup | None = None,
    **options: Any,
) -> BucketReducer:
    """The reducer called ``name`` over ``group`` (default: the default group).

    ``collective``: a :class:`~gradhub.collective.CollectiveGroup` of the same
    ranks; the built-in reducers then reduce on its transport (see the module
    docstring). Reducers added with :func:`register` are built with
    ``group=`` and their options only.
    """
    factory = codecs.reducer_factory(name)
    if collective is not None and name in _BUILT_IN:
        options["collective"] = collective
    reducer = factory(group=group, **options)
    if not isinstance(reducer, BucketReducer):
        raise TypeError(f"the factory of {name!r} returned {reducer!r}, which has no reduce()")
    return reducer
