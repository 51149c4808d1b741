"""The checkpoint checks of the DDP-conformance job (see ``conformance_jobs``).

The orders real scripts use: optimizer state loaded into the plain optimizer
before ``prepare`` (nanoGPT's ``init_from='resume'``); model and optimizer
loaded after ``prepare`` (pytorch/examples' imagenet); ``model.state_dict()``
and ``optimizer.state_dict()`` called on rank 0 alone (both), which must not
wait for the other rank. This module is imported after ``conformance_checks``,
so its checks run last: the rank-0-only one can leave a collective unmatched.
"""

from __future__ import annotations

import copy
import io
import time
from typing import Any

import torch
from torch import nn

from conformance_checks import adamw_groups, compare, run_steps
from conformance_jobs import ALL, TIMEOUT, Ctx, Tagged, arrays, check, ddp, is_gradhub_error, mlp


def pretrained() -> tuple[dict[str, Any], dict[str, Any]]:
    """Two single-process AdamW steps (the same on every rank): a checkpoint."""
    model = mlp()
    opt = adamw_groups(model)
    run_steps(model, opt, 0, steps=2)
    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def other_init() -> nn.Module:
    return mlp(seed=1)


@check(*ALL)
def check_checkpoint_before_prepare(ctx: Ctx) -> Any:
    """nanoGPT's resume: the state is loaded into the plain model and optimizer,
    then ``prepare`` (DDP: then the wrap)."""
    weights, state = pretrained()

    def model_from_checkpoint() -> nn.Module:
        model = other_init()
        model.load_state_dict(weights)
        return model

    def optimizer_from_checkpoint(model: nn.Module) -> torch.optim.Optimizer:
        opt = adamw_groups(model)
        opt.load_state_dict(copy.deepcopy(state))
        return opt

    return compare(ctx, model_from_checkpoint, optimizer_from_checkpoint, steps=2)


@check(*ALL)
def check_checkpoint_after_prepare(ctx: Ctx) -> Any:
    """imagenet's resume: ``model.load_state_dict`` and ``optimizer.load_state_dict``
    on the wrapped objects, every rank."""
    weights, state = pretrained()

    def load(model: Any, opt: Any) -> None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model.module.load_state_dict(weights)  # DDP's keys carry "module."
        elif isinstance(getattr(model, "module", None), Tagged):
            tag = model.module.tag
            model.load_state_dict({f"{tag}.{k}": v for k, v in weights.items()})
        else:
            model.load_state_dict(weights)
        opt.load_state_dict(copy.deepcopy(state))

    return compare(ctx, other_init, adamw_groups, steps=2, after_prepare=load)


@check(*ALL)
def check_checkpoint_from_ddp(ctx: Ctx) -> Any:
    """A checkpoint a DDP run wrote (imagenet saves the wrapped model's
    ``state_dict()``: every key starts with ``module.``), loaded after ``prepare``
    with the unchanged ``model.load_state_dict(checkpoint["state_dict"])``: DDP's
    values, or a typed error saying what to write."""
    weights, _ = pretrained()
    base = other_init()
    model, _ = ctx.prepare(base, adamw_groups(base))
    tag = f"{model.module.tag}." if isinstance(model.module, Tagged) else ""
    try:
        model.load_state_dict({f"module.{tag}{k}": v for k, v in weights.items()})
    except Exception as exc:  # the class is the result
        return {"refused": is_gradhub_error(exc)}
    loaded = model.state_dict()
    return {
        "gradhub": [loaded[f"{tag}{k}"].numpy().copy() for k in weights],
        "reference": [v.numpy().copy() for v in weights.values()],
    }


@check(*ALL)
def check_checkpoint_rank0_only(ctx: Ctx) -> Any:
    """nanoGPT: ``if master_process: torch.save({'model': raw_model.state_dict(),
    'optimizer': optimizer.state_dict(), ...})`` while the other rank goes on
    (here: it waits for the file through the store, then both meet at a barrier)."""
    base = mlp()
    model, opt = ctx.prepare(base, adamw_groups(base))
    steps = not (ctx.alone and ctx.rank != 0)
    if steps:
        run_steps(model, opt, ctx.rank, steps=2)
    out: dict[str, Any] = {}
    saved = f"saved/{ctx.tag}"
    if ctx.rank == 0:
        start = time.monotonic()
        checkpoint = {"model": model.state_dict(), "optimizer": opt.state_dict(), "iter_num": 2}
        out["seconds"] = time.monotonic() - start
        out["file"] = to_bytes(checkpoint)
        out["tag"] = getattr(model.module, "tag", None)
        ctx.store.set(saved, "1")
    else:
        from datetime import timedelta

        ctx.store.wait([saved], timedelta(seconds=2 * TIMEOUT))
    torch.distributed.barrier()  # the script's next collective
    out["gradhub"] = arrays(base)
    model.close()
    if not steps:
        return out
    ref = mlp()
    ref_opt = adamw_groups(ref)
    if ctx.sync:
        run_steps(ddp(ref), ref_opt, ctx.rank, steps=2)
    else:
        run_steps(ref, ref_opt, ctx.rank, steps=2, share=ctx.share)
    out["reference"] = to_bytes({"model": ref.state_dict(), "optimizer": ref_opt.state_dict()})
    return out


def to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    """As a plain script loads it: ``weights_only=True``."""
    return torch.load(io.BytesIO(data), weights_only=True)
