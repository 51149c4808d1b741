"""Jobs of ``test_sharded_conformance.py``: a DDP script's lines under ``sharded``.

The single-process reference (:func:`reference`) is one process on the
combined batch: rank 0's half goes through the model's ``extra`` branch and
rank 1's does not, the loss is the mean of the two halves' mean losses (what
DDP averages), so a parameter used on one rank only is covered; ``unused``
is used nowhere.
"""

from __future__ import annotations

import io
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gradhub
from gradhub.collective.sharded_optimizer import ELEMENTWISE
from gradhub.errors import CollectiveTimeoutError, MisuseError
from gradhub.train.strategies.sharded_state import ShardResponder

STEPS = 4  # steps of the main run; the rank-0-alone state dict is taken after 2
CLIP = 0.05  # below the gradient norms: every step clips
SPIKE = 1e37  # rank 1's loss factor at step 1 of the scaler run: overflows when scaled


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 16)
        self.extra = nn.Linear(16, 16)  # used by rank 0's half only
        self.unused = nn.Linear(4, 4)  # used by nobody
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's: decay on matrices, none on biases."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
        lr=0.01,
    )


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(3, 6, generator=g), torch.randint(0, 3, (3,), generator=g)


def local_loss(model: Any, step: int, rank: int, spike: bool = False) -> torch.Tensor:
    x, y = batch(step, rank)
    loss = F.cross_entropy(model(x, extra=rank == 0), y)
    return loss * SPIKE if spike and rank == 1 and step == 1 else loss


def params(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for p in model.parameters()]


def to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def reference(
    steps: range,
    make_opt: Any = adamw,
    *,
    start: bytes | None = None,
    scaler: bool = False,
    clip: bool = True,
) -> dict[str, Any]:
    """One process, both halves: parameters and norms per step, states after 2 and 4."""
    model = Net()
    opt = make_opt(model)
    if start is not None:
        weights, state = from_bytes(start)
        model.load_state_dict(weights)
        opt.load_state_dict(state)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
    out: dict[str, Any] = {"params": [], "norms": [], "scales": [], "states": {}}
    for step in steps:
        opt.zero_grad()
        loss = sum(local_loss(model, step, r, spike=scaler) for r in (0, 1)) / 2
        if amp is not None:
            amp.scale(loss).backward()
            amp.unscale_(opt)
        else:
            loss.backward()
        if clip:
            out["norms"].append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        if amp is not None:
            amp.step(opt)
            out["scales"].append(amp.get_scale())
            amp.update()
        else:
            opt.step()
        out["params"].append(params(model))
        if step + 1 in (2, 4):
            out["states"][step + 1] = to_bytes((model.state_dict(), opt.state_dict()))
    return out


# --- the 2-rank job ------------------------------------------------------------------------


def job(rank: int, world: int, start: bytes) -> dict[str, Any]:
    """Every multi-process check of the conformance test, in one job."""
    with gradhub.init(timeout=60) as runtime:
        out: dict[str, Any] = {"torch clip": _train(rank, runtime, "torch")}
        out["gradhub clip"] = _train(rank, runtime, "gradhub")
        out["scaler"] = _scaled(rank, runtime)
        out["bf16 wire"] = _grads_on_the_wire(rank, runtime)
        out["bf16 parameters"] = _bf16(rank, runtime)
        out["optimizers"] = {
            name: _elementwise(rank, runtime, name) for name in sorted(ELEMENTWISE)
        }
        out["resume"] = _resume(rank, runtime, start)
        out["another strategy"] = _other_strategy(rank, runtime, out["torch clip"]["final state"])
        out["responder"] = _responder(rank, runtime)
        out["between"] = _between(rank, runtime)
        return out


def _train(rank: int, runtime: Any, clip: str) -> dict[str, Any]:
    """AdamW with decay groups, a clip every step, rank 0's state dicts taken alone."""
    base = Net()
    model, opt = gradhub.prepare(base, adamw(base), strategy="sharded", runtime=runtime)
    out: dict[str, Any] = {"params": [], "norms": [], "grads": [], "none": []}
    with model:
        for step in range(STEPS):
            opt.zero_grad()
            local_loss(model, step, rank).backward()
            out["none"].append([p.grad is None for p in base.parameters()])
            out["grads"].append(
                [None if p.grad is None else p.grad.numpy().copy() for p in base.parameters()]
            )
            if clip == "torch":
                norm = nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            else:
                norm = gradhub.clip_grad_norm_(model, CLIP)
            out["norms"].append(float(norm))
            opt.step()
            out["params"].append(params(base))
            if step == 1 and rank == 0:
                # nanoGPT's checkpoint: rank 0 alone, while rank 1 runs on into
                # step 2's backward (where it waits for rank 0 in a collective).
                out["state at 2"] = to_bytes((model.state_dict(), opt.state_dict()))
        out["final state"] = to_bytes((model.state_dict(), opt.state_dict()))  # every rank
        if rank == 0:
            # imagenet's last checkpoint: rank 0 alone, after rank 1 is done (its
            # close answers on until every rank has closed)
            time.sleep(0.3)
            out["after close"] = to_bytes(opt.state_dict())
    return out


def _scaled(rank: int, runtime: Any) -> dict[str, Any]:
    """torch's GradScaler, unscale_ then torch's clip; step 1 overflows (skipped)."""
    base = Net()
    model, opt = gradhub.prepare(base, sgd(base), strategy="sharded", runtime=runtime)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    out: dict[str, Any] = {"params": [], "scales": []}
    with model:
        for step in range(STEPS):
            opt.zero_grad()
            amp.scale(local_loss(model, step, rank, spike=True)).backward()
            amp.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            amp.step(opt)
            out["scales"].append(amp.get_scale())
            amp.update()
            out["params"].append(params(base))
    return out


def _grads_on_the_wire(rank: int, runtime: Any) -> dict[str, Any]:
    """compress="bf16": .grad after backward, two steps."""
    base = Net()
    model, opt = gradhub.prepare(
        base, sgd(base), strategy="sharded", runtime=runtime, compress="bf16"
    )
    grads = []
    with model:
        for step in range(2):
            opt.zero_grad()
            local_loss(model, step, rank).backward()
            grads.append([p.grad.numpy().copy() for p in base.parameters() if p.grad is not None])
            opt.step()
        gradhub.check_in_sync(model)
    return {"grads": grads}


def _bf16(rank: int, runtime: Any) -> list[list[np.ndarray]]:
    """bf16 parameters: fp32 master slices, bf16 model copies."""
    base = Net().to(torch.bfloat16)
    model, opt = gradhub.prepare(base, sgd(base), strategy="sharded", runtime=runtime)
    out = []
    with model:
        for step in range(2):
            opt.zero_grad()
            x, y = batch(step, rank)
            F.cross_entropy(model(x.bfloat16(), extra=rank == 0).float(), y).backward()
            opt.step()
            out.append([p.detach().float().numpy().copy() for p in base.parameters()])
    return out


def bf16_reference() -> list[list[np.ndarray]]:
    """One process: a bf16 model for forward and backward, fp32 master weights
    stepped by SGD with its gradients, copied back rounded to bf16."""
    model = Net().to(torch.bfloat16)
    master = Net()
    with torch.no_grad():
        for m, p in zip(master.parameters(), model.parameters(), strict=True):
            m.copy_(p.float())
    opt = sgd(master)
    out = []
    for step in range(2):
        model.zero_grad()
        total = torch.zeros(())
        for r in (0, 1):
            x, y = batch(step, r)
            total = total + F.cross_entropy(model(x.bfloat16(), extra=r == 0).float(), y) / 2
        total.backward()
        for m, p in zip(master.parameters(), model.parameters(), strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        opt.step()
        with torch.no_grad():
            for m, p in zip(master.parameters(), model.parameters(), strict=True):
                p.copy_(m)
        out.append([p.detach().float().numpy().copy() for p in model.parameters()])
    return out


def _elementwise(rank: int, runtime: Any, name: str) -> list[list[np.ndarray]]:
    base = Net()
    cls = getattr(torch.optim, name)
    model, opt = gradhub.prepare(
        base, cls(base.parameters(), lr=0.01), strategy="sharded", runtime=runtime
    )
    out = []
    with model:
        for step in range(2):
            opt.zero_grad()
            local_loss(model, step, rank).backward()
            opt.step()
            out.append(params(base))
    return out


def _resume(rank: int, runtime: Any, start: bytes) -> dict[str, list[list[np.ndarray]]]:
    """A plain single-process checkpoint (after 2 steps), resumed for 2 steps in
    nanoGPT's order (state into the plain optimizer, then prepare) and in
    imagenet's (prepare, then load into the prepared model and optimizer)."""
    weights, state = from_bytes(start)
    out: dict[str, list[list[np.ndarray]]] = {}
    for order in ("before prepare", "after prepare"):
        base = Net()
        plain = adamw(base)
        if order == "before prepare":
            base.load_state_dict(weights)
            plain.load_state_dict(state)
        model, opt = gradhub.prepare(base, plain, strategy="sharded", runtime=runtime)
        if order == "after prepare":
            model.load_state_dict(weights)
            opt.load_state_dict(state)
        out[order] = []
        with model:
            for step in range(2, STEPS):
                opt.zero_grad()
                local_loss(model, step, rank).backward()
                nn.utils.clip_grad_norm_(model.parameters(), CLIP)
                opt.step()
                out[order].append(params(base))
    return out


def _other_strategy(rank: int, runtime: Any, final: bytes) -> list[list[np.ndarray]]:
    """The sharded run's final model and optimizer state resumed under allreduce."""
    weights, state = from_bytes(final)
    base = Net()
    model, opt = gradhub.prepare(base, adamw(base), strategy="allreduce", runtime=runtime)
    out = []
    with model:
        model.load_state_dict(weights)
        opt.load_state_dict(state)
        for step in range(STEPS, STEPS + 2):
            opt.zero_grad()
            local_loss(model, step, rank).backward()
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            out.append(params(base))
    return out


def _responder(rank: int, runtime: Any) -> dict[str, Any]:
    """A 9 MiB answer (chunks under the store's 8 MiB limit); then a rank that
    runs no responder: a timeout naming it."""
    payload = bytes(range(256)) * (9 << 12)  # 9 MiB
    out: dict[str, Any] = {}
    with ShardResponder(runtime.store, "test/answer/", rank, 2, 30.0, lambda: payload) as r:
        if rank == 0:
            out["answer"] = r.request("state_dict") == {1: payload}
    if rank == 0:
        with ShardResponder(runtime.store, "test/silent/", rank, 2, 2.0, lambda: b"") as r:
            try:
                r.request("optimizer.state_dict()")
            except CollectiveTimeoutError as exc:
                out["timeout"] = (list(exc.missing_ranks), str(exc))
    return out


def _between(rank: int, runtime: Any) -> dict[str, Any]:
    """``optimizer.state_dict()`` between a backward and its step: refused, and the
    step and a read after it go on as if it had not been called."""
    base = Net()
    model, opt = gradhub.prepare(base, adamw(base), strategy="sharded", runtime=runtime)
    out: dict[str, Any] = {}
    with model:
        for step in range(2):
            opt.zero_grad()
            local_loss(model, step, rank).backward()
            if step == 1:
                try:
                    opt.state_dict()
                except MisuseError as exc:
                    out["refused"] = str(exc)
            opt.step()
        out["after"] = to_bytes(opt.state_dict())
        out["params"] = params(base)
    return out
