"""Rank jobs of test_overlap.py: when each reduction runs against the backward.

The model is a chain of blocks whose backward sleeps a fixed time, leaving
the CPU idle as a GPU kernel keeps the host waiting. Each block holds one
parameter of exactly one bucket. Every reduce-scatter, all-gather and
all-reduce the shared-memory transport runs (an all-reduce once, also where
it runs as the other two) is recorded with its start and end, beside the
start of each block's backward.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

BLOCKS = 4
NUMEL = 1 << 18  # 1 MB of fp32: one bucket per block with bucket_mb=1
SLEEP = 0.1


class _SleepingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, index: int, log: list[Any]) -> Any:
        ctx.index, ctx.log = index, log
        return x + w[:1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        ctx.log.append(("backward", ctx.index, time.monotonic()))
        time.sleep(SLEEP)  # the host waits, as for a device computing
        return g, torch.full((NUMEL,), 1e-3) * g.sum(), None, None


class SleepingBlock(nn.Module):
    def __init__(self, index: int, log: list[Any]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(NUMEL))
        self.index, self.log = index, log

    def forward(self, x: torch.Tensor) -> Any:
        return _SleepingBackward.apply(x, self.w, self.index, self.log)


def sleeping_model(log: list[Any], blocks: int = BLOCKS) -> nn.Sequential:
    return nn.Sequential(*[SleepingBlock(i, log) for i in range(blocks)])


def _record_transport(log: list[Any]) -> None:
    from gradhub.transports.shm import ShmTransport

    depth = [0]  # an all_reduce may run as a reduce_scatter and an all_gather: log it once

    for name in ("reduce_scatter", "all_gather", "all_reduce"):
        method = getattr(ShmTransport, name)

        def recorded(self: Any, *args: Any, _m: Any = method, _n: str = name, **kw: Any) -> Any:
            begin = time.monotonic()
            depth[0] += 1
            try:
                return _m(self, *args, **kw)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    log.append((_n, begin, time.monotonic()))

        setattr(ShmTransport, name, recorded)


def reductions_against_backward(rank: int, world_size: int, how: str) -> dict[str, Any]:
    """Three steps under ``how`` (``"allreduce"``, ``"sharded"``, either with
    ``" (no overlap)"``, or ``"DDP on gradhub"``);
    the third step's record: each block's backward start, each transport call."""
    import torch.distributed as dist

    import gradhub

    log: list[Any] = []
    x = torch.ones(2, 1)
    if how == "DDP on gradhub":
        dist.init_process_group("gradhub", timeout=__import__("datetime").timedelta(seconds=60))
        base = sleeping_model(log)
        model: Any = nn.parallel.DistributedDataParallel(base, bucket_cap_mb=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        runtime = None
    else:
        runtime = gradhub.init(timeout=60)
        base = sleeping_model(log)
        strategy, _, rest = how.partition(" ")  # "allreduce (no overlap)": overlap=False
        model, opt = gradhub.prepare(
            base,
            torch.optim.SGD(base.parameters(), lr=0.1),
            strategy=strategy,
            bucket_mb=1,
            overlap=rest != "(no overlap)",
        )
    _record_transport(log)
    try:
        for _ in range(3):
            log.clear()
            opt.zero_grad(set_to_none=True)
            model(x).sum().backward()
            opt.step()
        return {
            "backward": {i: t for kind, i, t in log if kind == "backward"},
            "calls": [(kind, a, b) for kind, a, b in log if kind != "backward"],
        }
    finally:
        if runtime is not None:
            model.close()
            runtime.close()
        else:
            dist.destroy_process_group()
