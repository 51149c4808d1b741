"""The plain reducers: ``compress="none"`` (one fp32 all-reduce of the bucket)
and ``"fp16"`` / ``"bf16"`` (16 bits on the wire); what the 16-bit ones mean
through a group and without one is in :mod:`gradhub.train.reducers`'s docstring."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradhub import codecs
from gradhub.collective import CollectiveGroup, all_reduce
from gradhub.train.reducers.base import Ready, StreamWork


def on_native_device(bucket: torch.Tensor, collective: CollectiveGroup) -> bool:
    """Whether ``bucket`` lives on a device whose collectives the process group
    runs itself (CUDA under NCCL): then the bucket goes to it straight from the
    backward hook, on the device's streams, as DDP's reducer does."""
    return bucket.device.type == "cuda" and "nccl" in collective.backend


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
