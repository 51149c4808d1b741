"""Rank jobs of test_host_syncs.py: what a steady-state step reads back from tensors.

A step's reads are counted two ways while two steps run on every rank:
torch's profiler (``aten::item`` / ``aten::_local_scalar_dense``, what a
device read dispatches to: a host synchronisation on a GPU), and the
Python-level reads of any tensor (``bool``, ``float``, ``int``, ``item``,
``tolist``, ``numpy``) with the file and line that made them.
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

_READS = ("__bool__", "__float__", "__int__", "__index__", "item", "tolist", "numpy")
_DEVICE_READS = ("aten::item", "aten::_local_scalar_dense")


@contextmanager
def python_reads() -> Iterator[collections.Counter[str]]:
    """Counts every Python-level read of a tensor's values, by ``method file:line``."""
    where: collections.Counter[str] = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def counting(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = traceback.extract_stack(limit=2)[0]
            where[f"{name} {caller.filename.split('/src/')[-1]}:{caller.lineno}"] += 1
            return method(self, *args, **kwargs)

        return read

    for name, method in saved.items():
        setattr(torch.Tensor, name, counting(name, method))
    try:
        yield where
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def count_reads(step: Callable[[], None], steps: int = 2) -> tuple[int, dict[str, int]]:
    """(device reads the profiler saw, Python-level reads by place) over ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile

    with python_reads() as where, profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    device = sum(e.count for e in prof.key_averages() if e.key in _DEVICE_READS)
    return device, dict(where)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 160), nn.ReLU(), nn.Linear(160, 4))


def steady_step_reads(
    rank: int, world_size: int, strategy: str, options: dict[str, Any], samples: bool
) -> tuple[int, dict[str, int]]:
    """A plain loop under ``strategy`` (``"DDP"``: torch's own); after three warm-up
    steps, the reads of two steps. ``samples``: ``set_samples(n, global)`` each step
    (what ``fit`` does)."""
    import gradhub

    runtime = gradhub.init(timeout=60)
    base = _model()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
    if strategy == "DDP":
        model: Any = nn.parallel.DistributedDataParallel(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        model, opt = gradhub.prepare(
            base, torch.optim.SGD(base.parameters(), lr=0.1), strategy=strategy, **options
        )

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if samples:
            model.set_samples(len(x), len(x) * world_size)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    try:
        for _ in range(3):
            step()
        return count_reads(step)
    finally:
        if strategy != "DDP":
            model.close()
        runtime.close()
