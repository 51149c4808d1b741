"""Shared pieces of the training tests: a tiny model, fixed data, a reference step."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import gradhub
from gradhub.train.strategies import make_strategy


def tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def fixed_data(n: int = 8, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def reference_step(
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], steps: int = 1
) -> list[torch.Tensor]:
    """Parameters after ``steps`` single-process steps on all 8 samples."""
    model = tiny_model()
    opt = make_optimizer(list(model.parameters()))
    x, y = fixed_data()
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """The optimizer of the uneven-batch tests and of their reference."""
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def uneven_steps(
    rank: int, world_size: int, strategy: str, options: dict[str, Any], optimizer: bool = True
) -> list[np.ndarray]:
    """One rank of a 2-rank job: 3 steps of ``strategy`` on :func:`uneven_part`.

    Rank 1 starts from other weights, so set-up must make it adopt rank 0's.
    ``optimizer=False`` gives the strategy none (the parameter servers hold it).
    Returns the parameters after the steps, as NumPy arrays.
    """
    runtime = gradhub.init(timeout=30)
    model = tiny_model(seed=0 if rank == 0 else 7)
    opt = sgd(list(model.parameters())) if optimizer else None
    steps = make_strategy(strategy, **options)
    steps.setup(model, opt, runtime)
    x, y = uneven_part(rank)
    for _ in range(3):
        steps.step(lambda: nn.functional.cross_entropy(model(x), y), len(x), 8)
    steps.close()
    runtime.close()
    return [p.detach().numpy().copy() for p in model.parameters()]


def uneven_part(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0 gets samples 0-4 (5 samples), rank 1 samples 5-7 (3 samples)."""
    x, y = fixed_data()
    return (x[:5], y[:5]) if rank == 0 else (x[5:], y[5:])


@contextlib.contextmanager
def counting_backend_all_reduce() -> Iterator[Counter[torch.dtype]]:
    """Counts ``torch.distributed.all_reduce`` calls by dtype inside the block (in
    one rank's process): what went to the backend's own all-reduce rather than
    to gradhub's transport (shared memory on one host calls none)."""
    counts: Counter[torch.dtype] = Counter()
    real = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counts[tensor.dtype] += 1
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counted
    try:
        yield counts
    finally:
        dist.all_reduce = real
