"""Shared pieces of the training tests: a tiny model, fixed data, a reference step."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


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


def uneven_part(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0 gets samples 0-4 (5 samples), rank 1 samples 5-7 (3 samples)."""
    x, y = fixed_data()
    return (x[:5], y[:5]) if rank == 0 else (x[5:], y[5:])
