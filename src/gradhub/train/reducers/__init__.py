"""Bucket reducers: how the ``allreduce`` strategy sums one gradient bucket.

The extension point of ``allreduce``'s communication, like DDP's comm hooks.
A reducer is any object with (:class:`BucketReducer`, in :mod:`.base`)

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
``"bf16"`` (16 bits on the wire; :mod:`.allreduce`), ``"powersgd"``
(:mod:`.powersgd`). :func:`register` adds a name (:mod:`.registry`).

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
returns a ``torch.futures.Future`` of the summed bucket (:mod:`.comm_hook`).

``"fp16"`` does not saturate either way: a contribution or sum beyond
+-65504 arrives as inf, which a loss scaler counts as found inf.
"""

from gradhub.train.reducers.allreduce import AllReduce, HalfAllReduce, on_native_device
from gradhub.train.reducers.base import BucketReducer, Ready, ReducerFactory, StreamWork
from gradhub.train.reducers.comm_hook import CommHook, GradBucket
from gradhub.train.reducers.powersgd import PowerSGD, PowerSGDConfig
from gradhub.train.reducers.registry import available, check_name, make, register

__all__ = [
    "AllReduce",
    "BucketReducer",
    "CommHook",
    "GradBucket",
    "HalfAllReduce",
    "PowerSGD",
    "PowerSGDConfig",
    "Ready",
    "ReducerFactory",
    "StreamWork",
    "available",
    "check_name",
    "make",
    "on_native_device",
    "register",
]
