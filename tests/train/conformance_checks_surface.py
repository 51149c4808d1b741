"""The optimizer and DDP-surface checks of the DDP-conformance job (see
``conformance_jobs``): optimizers that are not elementwise, bf16, ``join()``,
DDP's keyword arguments, ``register_comm_hook``, several optimizers and a
script's own optimizer class. Each either gives its reference's result or
meets a refusal, which the pytest side requires to be a typed error that
says what to write instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import gradhub
from conformance_checks import compare, run_steps, sgd
from conformance_jobs import (
    ALL,
    SYNC,
    Ctx,
    arrays,
    batch,
    check,
    ddp,
    is_gradhub_error,
    loss_of,
    mlp,
)


@check(*ALL)
def check_adafactor(ctx: Ctx) -> Any:
    """Adafactor: a tuple holding None (``eps``), and an update that is not elementwise
    (row and column statistics of each matrix)."""
    return _maybe_refused(ctx, lambda: compare(ctx, mlp, _adafactor))


def _adafactor(model: Any) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(model.parameters(), lr=0.05)


def _maybe_refused(ctx: Ctx, run: Callable[[], Any]) -> Any:
    """The run's result, or the refusal it met (a GradhubError, on every rank)."""
    try:
        return run()
    except gradhub.GradhubError as exc:
        return {"refused": is_gradhub_error(exc)}
    except (TypeError, ValueError, RuntimeError) as exc:
        return {"refused": is_gradhub_error(exc)}


def _no_bias_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16, bias=False), nn.Tanh(), nn.Linear(16, 3, bias=False))


@check(*ALL)
def check_muon(ctx: Ctx) -> Any:
    """Muon orthogonalises each matrix's update: it needs whole tensors."""
    make = lambda m: torch.optim.Muon(m.parameters(), lr=0.02)  # noqa: E731
    return _maybe_refused(ctx, lambda: compare(ctx, _no_bias_mlp, make))


@check(*ALL)
def check_bf16_parameters(ctx: Ctx) -> Any:
    def make() -> nn.Module:
        return mlp().to(torch.bfloat16)

    def fwd(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(model(x.to(torch.bfloat16)).float(), y)

    return _maybe_refused(
        ctx,
        lambda: compare(ctx, make, lambda m: torch.optim.SGD(m.parameters(), lr=0.1), forward=fwd),
    )


# 7. join ------------------------------------------------------------------------------------


@check(*ALL)
def check_join(ctx: Ctx) -> Any:
    """Rank 0 has 3 batches, rank 1 has 2: ``with model.join():`` as DDP's."""
    mine = 3 if ctx.rank == 0 else 2

    def loop_body(model: Any, opt: Any) -> None:
        for step in range(mine):
            x, y = batch(step, 0, ctx.rank)
            opt.zero_grad()
            loss_of(model, x, y).backward()
            opt.step()

    base = mlp()
    model, opt = ctx.prepare(base, sgd(base))
    try:
        joined = model.join()
    except gradhub.GradhubError as exc:  # refused at the line, before any step
        return {"refused_at_join": is_gradhub_error(exc)}
    try:
        with joined:
            loop_body(model, opt)
    except gradhub.GradhubError as exc:
        ctx.dirty = True  # the other rank may be left in a collective
        return {"refused": is_gradhub_error(exc)}
    out: dict[str, Any] = {"gradhub": arrays(base)}
    model.close()
    if ctx.strategy in SYNC:
        ref = mlp()
        wrapped = ddp(ref)
        with wrapped.join():
            loop_body(wrapped, sgd(ref))
        out["reference"] = arrays(ref)
    return out


# 8. DDP's keyword arguments, register_comm_hook --------------------------------------------

DDP_KWARGS: dict[str, Any] = {
    "find_unused_parameters": True,
    "broadcast_buffers": True,
    "gradient_as_bucket_view": True,
    "static_graph": False,
    "bucket_cap_mb": 25,
    "device_ids": None,
    "output_device": None,
}


@check(*ALL)
def check_ddp_keyword_arguments(ctx: Ctx) -> Any:
    """Each accepted (one step runs) or refused with a typed error that says why."""
    out: dict[str, Any] = {}
    for name, value in DDP_KWARGS.items():
        base = mlp()
        try:
            model, opt = ctx.prepare(base, sgd(base), **{name: value})
        except Exception as exc:
            out[name] = is_gradhub_error(exc)
            continue
        run_steps(model, opt, ctx.rank, steps=1)
        model.close()
        out[name] = "accepted"
    return out


@check(*ALL)
def check_register_comm_hook(ctx: Ctx) -> Any:
    """DDP's fp16_compress_hook: DDP's result, or a typed error pointing at compress=."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def hook(model: Any, _opt: Any) -> None:
        if not isinstance(model, nn.Sequential):  # the prepared model, or DDP
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)

    try:
        return compare(ctx, mlp, sgd, after_prepare=hook)
    except Exception as exc:
        return {"refused": is_gradhub_error(exc)}


# 9. several optimizers, any optimizer object ------------------------------------------------


class SignSGD(torch.optim.Optimizer):
    """A script's own optimizer class (not in torch.optim)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


@check(*ALL)
def check_custom_optimizer(ctx: Ctx) -> Any:
    make = lambda m: SignSGD(m.parameters(), lr=0.01)  # noqa: E731
    return _maybe_refused(ctx, lambda: compare(ctx, mlp, make))


class _Both:
    """Two optimizers over disjoint parameters, stepped together by the loop."""

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def step(self) -> None:
        self.first.step()
        self.second.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.first.zero_grad(set_to_none=set_to_none)
        self.second.zero_grad(set_to_none=set_to_none)


@check(*ALL)
def check_several_optimizers(ctx: Ctx) -> Any:
    """SGD on the first layer, Adam on the last: ``prepare(model, [sgd, adam])``."""

    def opts(model: nn.Module) -> list[torch.optim.Optimizer]:
        return [
            torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9),
            torch.optim.Adam(model[2].parameters(), lr=0.01),
        ]

    def run() -> Any:
        base = mlp()
        model, prepared = ctx.prepare(base, opts(base))
        if ctx.alone and ctx.rank != 0:
            return {"alone": True}
        run_steps(model, _Both(*prepared), ctx.rank)
        out: dict[str, Any] = {"gradhub": arrays(base)}
        model.close()
        ref = mlp()
        if ctx.sync:
            run_steps(ddp(ref), _Both(*opts(ref)), ctx.rank)
        else:
            run_steps(ref, _Both(*opts(ref)), ctx.rank, share=0.5)
        out["reference"] = arrays(ref)
        return out

    return _maybe_refused(ctx, run)
