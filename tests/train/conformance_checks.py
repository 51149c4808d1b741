"""The training-loop checks of the DDP-conformance job (see ``conformance_jobs``).

Each check runs an unchanged DDP loop on the prepared model and returns what
the pytest side compares: the parameters it ends with and a reference's, or
the typed refusal it met. The reference is DDP over gloo in the same
processes under ``allreduce``, ``sharded`` and ``ps-sync``; under
``ps-async``/``ps-ssp`` rank 0 steps alone and the reference is one process
on rank 0's batches with each gradient scaled by its share ``1 / world``
(what a worker pushes; the servers apply each push on its own). Under
``diloco`` every rank steps and its reference is one process on its own
batches (the checks stay between two syncs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradhub
from conformance_jobs import (
    ALL,
    Ctx,
    arrays,
    batch,
    check,
    ddp,
    loss_of,
    mlp,
)

MakeOpt = Callable[[Any], Any]


def run_steps(
    model: Any,
    opt: Any,
    rank: int,
    *,
    steps: int = 3,
    micro: int = 1,
    accumulate: str = "none",
    clip: Callable[[Any], Any] | None = None,
    make_scaler: Callable[[], Any] | None = None,
    after_step: Callable[[int, Any], None] | None = None,
    inf_at: tuple[int, int] | None = None,
    share: float = 1.0,
    forward: Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor] = loss_of,
) -> dict[str, list[float]]:
    """nanoGPT's step: micro-batches, scale, unscale_, clip, scaler.step/update.

    ``accumulate``: ``"attr"`` sets ``require_backward_grad_sync`` (nanoGPT),
    ``"no_sync"`` wraps all but the last micro-batch in ``no_sync()``,
    ``"every"`` lets every backward synchronise, ``"none"`` (a plain module,
    the single-process reference). ``share`` scales the gradient after the
    clip (the reference of a ``ps-async`` worker's push).
    """
    seen: dict[str, list[float]] = {"norms": [], "scales": []}
    scaler = make_scaler() if make_scaler is not None else None
    for step in range(steps):
        for m in range(micro):
            last = m == micro - 1
            x, y = batch(step, m, rank)
            quiet: Any = contextlib.nullcontext()
            if accumulate == "attr":  # before the forward, where DDP reads it
                model.require_backward_grad_sync = last
            elif accumulate == "no_sync" and not last:
                quiet = model.no_sync()
            with quiet:  # forward and backward inside, as DDP's docs write it
                loss = forward(model, x, y) / micro
                if inf_at == (step, rank):
                    loss = loss * float("inf")  # an overflow on this rank only
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        if clip is not None:
            seen["norms"].append(float(clip(model)))
        if share != 1.0:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(share)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
            seen["scales"].append(float(scaler.get_scale()))
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(step, opt)
    return seen


def compare(
    ctx: Ctx,
    make_model: Callable[[], nn.Module],
    make_opt: MakeOpt,
    *,
    prepare_options: dict[str, Any] | None = None,
    ddp_options: dict[str, Any] | None = None,
    after_prepare: Callable[[Any, Any], None] | None = None,
    **loop: Any,
) -> dict[str, Any]:
    """The loop on the prepared model, then on its reference (module doc)."""
    base = make_model()
    model, opt = ctx.prepare(base, make_opt(base), **(prepare_options or {}))
    if after_prepare is not None:
        after_prepare(model, opt)
    out: dict[str, Any] = {}
    if ctx.alone and ctx.rank != 0:
        model.close()
        return {"alone": True}
    out["seen"] = run_steps(model, opt, ctx.rank, **loop)
    out["gradhub"] = arrays(base)
    model.close()
    ref = make_model()
    if ctx.sync:
        wrapped = ddp(ref, **(ddp_options or {}))
        ref_opt = make_opt(ref)
        if after_prepare is not None:
            after_prepare(wrapped, ref_opt)
        out["ref_seen"] = run_steps(wrapped, ref_opt, ctx.rank, **loop)
    else:
        ref_opt = make_opt(ref)
        if after_prepare is not None:
            after_prepare(ref, ref_opt)
        loop = {**loop, "accumulate": "none", "share": ctx.share}
        out["ref_seen"] = run_steps(ref, ref_opt, ctx.rank, **loop)
    out["reference"] = arrays(ref)
    return out


def sgd(model: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def adamw_groups(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's configure_optimizers: decay for >= 2-d tensors, none for the rest."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=0.01, betas=(0.9, 0.95))


# 1. gradient accumulation -------------------------------------------------------------


@check(*ALL)
def check_accumulation_attr(ctx: Ctx) -> Any:
    """nanoGPT: ``model.require_backward_grad_sync = (micro_step == last)``."""
    return compare(ctx, mlp, sgd, micro=2, accumulate="attr")


@check(*ALL)
def check_accumulation_no_sync(ctx: Ctx) -> Any:
    return compare(ctx, mlp, sgd, micro=2, accumulate="no_sync")


@check(*ALL)
def check_accumulation_every(ctx: Ctx) -> Any:
    """Every micro-batch's backward synchronises (DDP allows it: the second
    combines what ``.grad`` holds plus the new local gradient)."""
    return compare(ctx, mlp, sgd, micro=2, accumulate="every")


# 2. torch's clip and GradScaler; 10. allreduce bit for bit -------------------------------


def _torch_clip(model: Any) -> Any:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


@check(*ALL)
def check_clip_torch(ctx: Ctx) -> Any:
    """torch's clip on ``model.parameters()``, as nanoGPT writes it (0.05: it clips);
    5 steps, where a drift of a few ulps from DDP has shown before."""
    return compare(ctx, mlp, sgd, steps=5, clip=_torch_clip)


@check(*ALL)
def check_clip_gradhub(ctx: Ctx) -> Any:
    """``gradhub.clip_grad_norm_`` against DDP with torch's clip."""
    base = mlp()
    model, opt = ctx.prepare(base, sgd(base))
    if ctx.alone and ctx.rank != 0:
        return {"alone": True}
    out = {
        "seen": run_steps(
            model, opt, ctx.rank, steps=5, clip=lambda m: gradhub.clip_grad_norm_(m, 0.05)
        )
    }
    out["gradhub"] = arrays(base)
    model.close()
    ref = mlp()
    if ctx.sync:
        out["ref_seen"] = run_steps(ddp(ref), sgd(ref), ctx.rank, steps=5, clip=_torch_clip)
    else:
        loop = {"steps": 5, "accumulate": "none", "share": ctx.share, "clip": _torch_clip}
        out["ref_seen"] = run_steps(ref, sgd(ref), ctx.rank, **loop)
    out["reference"] = arrays(ref)
    return out


@check(*ALL)
def check_grad_scaler(ctx: Ctx) -> Any:
    """torch.amp.GradScaler with fp16-style dynamic scaling; step 1 overflows on one
    rank (rank 1; rank 0 where it steps alone), so that step is skipped (under
    ``diloco`` on rank 1 only: each worker's scaler is its own)."""
    return compare(
        ctx,
        mlp,
        sgd,
        steps=4,
        clip=_torch_clip,
        inf_at=(1, 0 if ctx.alone else 1),
        make_scaler=lambda: torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2),
    )


# 3. unused parameters --------------------------------------------------------------------


class Branchy(nn.Module):
    """``only0`` is used by rank 0 only, ``never`` by no rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 3)
        self.only0 = nn.Linear(16, 3)
        self.never = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) + (self.only0(h) if rank == 0 else 0.0)


def _branchy_loss(rank: int) -> Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]:
    return lambda model, x, y: nn.functional.cross_entropy(model(x, rank), y)


@check(*ALL)
def check_unused_parameters(ctx: Ctx) -> Any:
    """AdamW with weight decay; DDP(find_unused_parameters=True) is the reference."""

    def opt_of(model: Any) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)

    base_never = Branchy().never.weight.detach().clone()
    out = compare(
        ctx,
        Branchy,
        opt_of,
        forward=_branchy_loss(ctx.rank),
        ddp_options={"find_unused_parameters": True},
    )
    if "gradhub" in out:
        never = out["gradhub"][6]  # never.weight (a, b, only0 before it: 2 tensors each)
        out["never_moved"] = float((torch.from_numpy(never) - base_never).abs().max())
    return out


@check(*ALL)
def check_unused_grad_is_none(ctx: Ctx) -> Any:
    """After the synchronising backward, ``.grad`` of the parameter no rank used is None."""
    base = Branchy()
    model, opt = ctx.prepare(base, torch.optim.AdamW(base.parameters(), lr=0.05))
    x, y = batch(0, 0, ctx.rank)
    nn.functional.cross_entropy(model(x, ctx.rank), y).backward()
    seen = {"after backward": base.never.weight.grad is None}
    opt.step()
    seen["after step"] = base.never.weight.grad is None
    return seen


# 4. rank 0's values at set-up, buffers at each forward -------------------------------------


class WithState(nn.Module):
    """A frozen layer, batch norm (buffers) and a buffer of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 3)
        self.register_buffer("offset", torch.randn(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.frozen(x) + self.offset))


@check(*ALL)
def check_rank0_values_at_setup(ctx: Ctx) -> Any:
    """Ranks seeded differently (nanoGPT seeds with 1337 + rank before building)."""
    torch.manual_seed(1337 + ctx.rank)
    base = WithState()
    before = arrays(base, buffers=True)
    trainable = [p for p in base.parameters() if p.requires_grad]
    ctx.prepare(base, torch.optim.SGD(trainable, lr=0.1))
    return {"before": before, "after": arrays(base, buffers=True)}


class NormFirst(nn.Module):
    """Batch norm on the input: its running statistics depend on the data only."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def _buffers(ctx: Ctx, broadcast: bool) -> Any:
    options = {} if broadcast else {"broadcast_buffers": False}
    base = NormFirst()
    model, opt = ctx.prepare(base, sgd(base), **options)
    run_steps(model, opt, ctx.rank, steps=3)
    out = {"gradhub": arrays(base), "buffers": arrays_of(base.buffers())}
    model.close()
    ref = NormFirst()
    # Rank 0's running statistics at each forward, then this rank's batch on top:
    # the same with any strategy, since they do not depend on the parameters.
    run_steps(ddp(ref, broadcast_buffers=broadcast), sgd(ref), ctx.rank)
    out.update({"reference": arrays(ref), "ref_buffers": arrays_of(ref.buffers())})
    return out


def arrays_of(tensors: Any) -> list[Any]:
    return [t.detach().float().numpy().copy() for t in tensors]


@check(*ALL)
def check_broadcast_buffers(ctx: Ctx) -> Any:
    return _buffers(ctx, broadcast=True)


@check(*ALL)
def check_broadcast_buffers_off(ctx: Ctx) -> Any:
    """``broadcast_buffers=False`` (DDP's keyword): each rank keeps its own statistics."""
    return _buffers(ctx, broadcast=False)


# 6. hyperparameters of every type, changed mid-run --------------------------------------


def _adam_everything(model: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(
        model.parameters(), lr=0.02, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.01, amsgrad=True
    )


@check(*ALL)
def check_hyperparameters(ctx: Ctx) -> Any:
    """Adam with tuples and bools (``betas``, ``amsgrad``); after 2 steps the script
    changes ``betas``, ``eps`` and ``lr``; 2 more steps."""

    def change(step: int, opt: Any) -> None:
        if step == 1:
            for group in opt.param_groups:
                group["betas"] = (0.5, 0.6)
                group["eps"] = 1e-3
                group["lr"] = 0.005  # as nanoGPT's schedule sets it

    return compare(ctx, mlp, _adam_everything, steps=4, after_step=change)
