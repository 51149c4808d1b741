"""Jobs of the ``ps-*`` conformance tests: DDP lines, unchanged, against a
single-process run on the combined batch (run in every rank by the harness)."""

from __future__ import annotations

import contextlib
import io
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import gradhub
from gradhub.train.strategies.ps.coordination import broadcast_json, on_rank0

WORLD = 2


class Net(nn.Module):
    """An MLP with a branch used on rank 0 only, one never used, a frozen parameter
    and a buffer."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        self.extra = nn.Linear(6, 3)
        self.never = nn.Linear(6, 3)
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.register_buffer("shift", torch.randn(3))

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        out = self.head(self.body(x)) + self.frozen + self.shift
        return out + self.extra(x) if extra else out


class Case(nn.Module):
    """A :class:`Net` under the name ``case``: each case has its own keys on the servers."""

    def __init__(self, case: str, seed: int = 0) -> None:
        super().__init__()
        self.case = case
        self.add_module(case, Net(seed))

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        net: Net = getattr(self, self.case)
        return net(x, extra)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    # Every kind of hyperparameter: a tuple, bools, None.
    return torch.optim.AdamW(
        model.parameters(),
        lr=0.02,
        betas=(0.8, 0.95),
        weight_decay=0.1,
        amsgrad=True,
        maximize=False,
        foreach=None,
    )


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(3, 6, generator=g), torch.randint(0, 3, (3,), generator=g)


def loss_of(model: Any, step: int, micro: int, rank: int | None, poison: bool) -> torch.Tensor:
    """Micro-batch ``micro``'s loss on ``rank``'s part (``None``: the combined batch,
    the mean over the ranks' parts). Rank 0 uses the extra branch; ``poison``
    makes rank 1's part infinite."""
    ranks = range(WORLD) if rank is None else [rank]
    total = torch.zeros(())
    for r in ranks:
        x, y = batch(step, micro, r)
        part = nn.functional.cross_entropy(model(x, extra=r == 0), y)
        if poison and r == 1:
            part = part * float("inf")
        total = total + part / (2 * (WORLD if rank is None else 1))  # 2 micro-batches
    return total


def loop(
    model: Any,
    opt: torch.optim.Optimizer,
    rank: int | None,
    steps: range,
    *,
    features: bool,
    grads: dict[str, Any] | None = None,
    twice: bool = False,
) -> None:
    """The DDP script under test: 2 micro-batches (``no_sync``; ``twice``: both
    backwards synchronise, which DDP allows with the same sum), torch's clip.
    ``features``: accumulation through ``require_backward_grad_sync``, torch's
    GradScaler (a skipped step at step 1), a scheduler, betas and weight decay
    changed by hand at step 2."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) if features else None
    quiet = model.no_sync if rank is not None and not twice else contextlib.nullcontext
    for step in steps:
        if features and step == 2:
            for group in opt.param_groups:
                group["betas"] = (0.5, 0.9)
                group["weight_decay"] = 0.05
        opt.zero_grad()
        for micro in range(2):
            poison = features and step == 1
            if features and rank is not None:  # nanoGPT's accumulation
                model.require_backward_grad_sync = micro == 1
                scaler.scale(loss_of(model, step, micro, rank, poison)).backward()
                continue
            with quiet() if micro == 0 else contextlib.nullcontext():  # DDP's no_sync
                loss = loss_of(model, step, micro, rank, poison)
                (scaler.scale(loss) if features else loss).backward()
        if grads is not None and step == 0:
            grads.update({n: _grad(p) for n, p in _named(model)})
        if features:
            scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # torch's own clip
        if features:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            sched.step()


def _named(model: Any) -> list[tuple[str, nn.Parameter]]:
    module = model.module if hasattr(model, "strategy") else model
    return list(module.named_parameters())


def _grad(p: nn.Parameter) -> np.ndarray | None:
    return None if p.grad is None else p.grad.detach().numpy().copy()


def values(model: nn.Module) -> dict[str, np.ndarray]:
    """Every parameter and buffer, by name."""
    return {n: t.detach().numpy().copy() for n, t in model.state_dict().items()}


def reference(case: str) -> dict[str, Any]:
    """The single-process runs: the feature loop for 4 steps then 2 plain ones;
    and 4 plain steps with a snapshot after 2."""
    model = Case(case)
    opt = adamw(model)
    grads: dict[str, Any] = {}
    loop(model, opt, None, range(4), features=True, grads=grads)
    after4 = values(model)
    loop(model, opt, None, range(4, 6), features=False)
    plain = Case(case)
    plain_opt = adamw(plain)
    loop(plain, plain_opt, None, range(2), features=False)
    snapshot = _copy((plain.state_dict(), plain_opt.state_dict()))  # not mutated by the steps
    loop(plain, plain_opt, None, range(2, 4), features=False)
    return {
        "grads": grads,
        "after4": after4,
        "after6": values(model),
        "plain4": values(plain),
        "snapshot": snapshot,
    }


def _copy(value: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def ps_sync_job(rank: int, world: int, address: str, saved: str) -> dict[str, Any]:
    runtime = gradhub.init(timeout=30)
    out: dict[str, Any] = {}
    options = {"servers": [address], "timeout": 30}
    try:
        # 1. The feature loop; ranks seeded differently; rank 0 checkpoints alone.
        base = Case("conf", seed=rank)
        model, opt = gradhub.prepare(base, adamw(base), strategy="ps-sync", **options)
        with model:
            out["setup"] = values(base)
            grads: dict[str, Any] = {}
            loop(model, opt, rank, range(4), features=True, grads=grads)
            out["grads"], out["after4"] = grads, values(base)
            if rank == 1:  # a buffer changed on rank 1 only; DDP broadcasts rank 0's
                base.conf.shift.add_(1.0)  # before the next forward
            model(torch.zeros(1, 6))
            out["buffer"] = base.conf.shift.numpy().copy()
            if rank == 0:  # alone: rank 1 waits at the barrier below meanwhile
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, saved)
            runtime.wait(dist.barrier(async_op=True), "barrier", where="after rank 0 saved")
        # 2. The files, loaded before prepare into a job of another strategy.
        files = torch.load(saved, weights_only=True)
        base = Case("conf", seed=rank + 5)
        base.load_state_dict(files["model"])
        plain_opt = adamw(base)
        plain_opt.load_state_dict(files["opt"])
        model, opt = gradhub.prepare(base, plain_opt, strategy="allreduce", runtime=runtime)
        with model:
            loop(model, opt, rank, range(4, 6), features=False)
            out["other_strategy"] = values(base)
        snapshot_model, snapshot_opt = reference("resume")["snapshot"]
        # 3. nanoGPT's order: model and optimizer state loaded before prepare.
        base = Case("resume", seed=rank + 10)
        base.load_state_dict(snapshot_model)
        plain_opt = adamw(base)
        plain_opt.load_state_dict(snapshot_opt)
        model, opt = gradhub.prepare(base, plain_opt, strategy="ps-sync", **options)
        with model:
            loop(model, opt, rank, range(2, 4), features=False)
            out["resume"] = values(base)
        # 4. imagenet's order: both loaded after prepare, after a step (the keys
        #    exist already: the servers hold case 3's values, which prepare pulls).
        base = Case("resume", seed=rank + 20)
        model, opt = gradhub.prepare(base, adamw(base), strategy="ps-sync", **options)
        with model:
            loop(model, opt, rank, range(7, 8), features=False)
            model.load_state_dict(snapshot_model)
            opt.load_state_dict(snapshot_opt)
            loop(model, opt, rank, range(2, 4), features=False, twice=True)
            out["reload"] = values(base)
    finally:
        runtime.close()
    return out


def broadcast_timeout_job(rank: int, world: int) -> tuple[str, str]:
    """Rank 0's work fails: every rank raises, rank 1 naming rank 0. Then rank 1
    never joins rank 0's broadcast: rank 0's error names it."""
    runtime = gradhub.init(timeout=2)
    try:

        def fail() -> int:
            raise ValueError("the servers refused the key")

        try:
            on_rank0(runtime, fail, "initialise the parameters on the servers", "ps-sync")
            failed = "no error"
        except Exception as exc:
            failed = f"{type(exc).__name__}: {exc}"
        if rank == 1:
            time.sleep(4)
            return failed, ""
        try:
            broadcast_json(runtime, {"plan": 1}, "restart of ps-sync: aligning the workers' steps")
        except gradhub.GradhubError as exc:
            return failed, f"{type(exc).__name__}: {exc}"
        return failed, "no error"
    finally:
        runtime.close()
