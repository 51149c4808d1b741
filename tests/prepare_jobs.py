"""Jobs of the own-loop tests (``gradhub.prepare``), run in every rank by the harness."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

import gradhub

ModelMaker = Callable[[], nn.Module]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


MODELS: dict[str, ModelMaker] = {"mlp": mlp, "cnn": SmallCNN}


def batch(kind: str, step: int, micro: int, rank: int, n: int = 3) -> tuple[torch.Tensor, ...]:
    """This rank's part of micro-batch ``micro`` of step ``step``."""
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    shape = (n, 6) if kind == "mlp" else (n, 1, 6, 6)
    return torch.randn(*shape, generator=g), torch.randint(0, 3, (n,), generator=g)


def global_batch(kind: str, step: int, micro: int, world: int) -> tuple[torch.Tensor, ...]:
    parts = [batch(kind, step, micro, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def train(
    model: Any,
    opt: torch.optim.Optimizer,
    kind: str,
    rank: int,
    world: int,
    *,
    steps: int = 5,
    clip: Callable[[], Any] | None = None,
    no_sync: Callable[[], Any] | None = None,
    single: bool = False,
) -> None:
    """The loop under test: 2-step accumulation, clipping, StepLR, an LR change at step 3."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(steps):
        if step == 3:  # a change by hand, on top of the schedule
            for group in opt.param_groups:
                group["lr"] = group["lr"] * 0.3
        opt.zero_grad()
        for micro in range(2):
            x, y = (
                global_batch(kind, step, micro, world) if single else batch(kind, step, micro, rank)
            )
            quiet = no_sync() if (no_sync is not None and micro == 0) else contextlib.nullcontext()
            with quiet:
                # Halved: the mean over both micro-batches, as a single process would.
                (nn.functional.cross_entropy(model(x), y) / 2).backward()
        if clip is not None:
            clip()
        opt.step()
        sched.step()


def params(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def single_process(kind: str, optimizer: str, world: int) -> list[np.ndarray]:
    """The reference: one process on the concatenated batches, same schedule."""
    model = MODELS[kind]()
    opt = make_optimizer(optimizer, model)
    train(
        model,
        opt,
        kind,
        0,
        world,
        single=True,
        clip=lambda: nn.utils.clip_grad_norm_(model.parameters(), 0.5),
    )
    return params(model)


def own_loop(rank: int, world: int, cases: list[tuple[str, str, str, dict[str, Any]]]) -> Any:
    """Run each (strategy, model, optimizer, options) case; DDP beside allreduce/sharded."""
    runtime = gradhub.init(timeout=30)
    out: dict[str, Any] = {}
    try:
        for strategy, kind, optimizer, options in cases:
            base = MODELS[kind]()
            model, opt = gradhub.prepare(
                base,
                make_optimizer(optimizer, base),
                strategy=strategy,
                runtime=runtime,
                **options,
            )
            with model:
                train(
                    model,
                    opt,
                    kind,
                    rank,
                    world,
                    clip=lambda m=model: gradhub.clip_grad_norm_(m, 0.5),
                    no_sync=model.no_sync,
                )
                gradhub.check_in_sync(model)
                out[f"{strategy}/{kind}"] = params(model.module)
            if strategy in ("allreduce", "sharded") and f"ddp/{kind}" not in out:
                ref = MODELS[kind]()
                ddp = nn.parallel.DistributedDataParallel(ref)
                ddp_opt = make_optimizer(optimizer, ref)
                train(
                    ddp,
                    ddp_opt,
                    kind,
                    rank,
                    world,
                    clip=lambda d=ddp: nn.utils.clip_grad_norm_(d.parameters(), 0.5),
                    no_sync=ddp.no_sync,
                )
                out[f"ddp/{kind}"] = params(ref)
    finally:
        runtime.close()
    return out
