"""A backward that leaves the CPU idle: what a GPU does to the host.

On a GPU the host waits while the device computes the backward; on a server
with more cores than ranks, cores stand idle beside it. Either way a
bucket's reduction can run while the backward goes on, and a step should
take about ``max(compute, communication)``, not their sum. This 2-core
machine has neither (the two ranks' backward passes fill both cores), so
the model here makes the room: ``BLOCKS`` blocks, each one parameter of
``NUMEL`` fp32 values (16 MB, one bucket each with ``BUCKET_MB``) whose
backward sleeps ``SLEEP`` seconds before producing its gradient.

``score = step / max(compute, communication)``, per round: ``compute`` is
the same step on the plain model (no communication), ``communication`` the
bucket all-reduces alone on the same path. 1.0: everything hidden; a step
that hides nothing scores about ``(compute + communication) / max(...)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

BLOCKS = 6
NUMEL = 4 << 20
SLEEP = 0.010
BUCKET_MB = 16.0


class _Sleeping(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> Any:
        return x + w[:1]

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> Any:
        time.sleep(SLEEP)  # the host waits, as for a device computing
        return g, torch.full((NUMEL,), 1e-4) * g.sum()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(NUMEL))

    def forward(self, x: torch.Tensor) -> Any:
        return _Sleeping.apply(x, self.w)


def model() -> nn.Module:
    return nn.Sequential(*[_Block() for _ in range(BLOCKS)])


def batch() -> torch.Tensor:
    return torch.ones(4, 1)


def loop_step(net: Any, opt: torch.optim.Optimizer, x: torch.Tensor) -> Callable[[], None]:
    """A plain loop's step: zero_grad, forward, backward, step."""

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        net(x).sum().backward()
        opt.step()

    return step


def buckets_reduced(all_reduce: Callable[[torch.Tensor], Any]) -> Callable[[], None]:
    """The communication alone: one all-reduce per block's bucket, waited at the end."""
    buckets = [torch.ones(NUMEL) for _ in range(BLOCKS)]

    def communicate() -> None:
        works = [all_reduce(b) for b in buckets]
        for w in works:
            if w is not None:
                w.wait()

    return communicate


def scores(
    times: dict[str, list[float]], compute: str, communication: dict[str, str]
) -> dict[str, list[float]]:
    """Per contender (``communication`` maps it to its communication row), the
    per-round ratio of its step to max(compute, communication) of that round."""
    out = {}
    for name, comm in communication.items():
        out[name] = [
            step / max(c, m)
            for step, c, m in zip(times[name], times[compute], times[comm], strict=True)
        ]
    return out
