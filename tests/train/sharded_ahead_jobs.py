"""Rank jobs of test_sharded_ahead.py: ``sharded``'s update taken during the backward.

:func:`same_bits_either_way` runs one script twice in each rank, with
``step_ahead`` on and off, and returns both runs' parameters and optimizer
state after every step; the script does, step by step, what the update
taken aside must survive (torch's clip, an LR changed between backward and
step, a backward with no step, a state loaded in between, a scheduler) as
well as plain steps. :func:`weights_against_backward` records when each
weight all-gather runs against the blocks' backward.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gradhub
from overlap_jobs import BLOCKS, sleeping_model

# What each step of the script does between backward and step.
PLAN = [
    "plain",
    "plain",
    "clip",  # torch's clip writes every .grad: the update aside is dropped
    "plain",  # paused one step after a drop
    "plain",
    "lr",  # an LR changed between backward and step
    "plain",
    "plain",
    "plain",
    "plain",
    "no step",  # a backward whose step is skipped
    "plain",
    "load",  # the optimizer's own state (read before the backward) loaded before the step
    "plain",
    "plain",
    "plain",
    "plain",
    "plain",
    "plain",
]


class Net(nn.Module):
    """Several buckets at bucket_mb=0.002; ``extra`` is used by rank 0's batches only."""

    def __init__(self, unused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 32)
        self.extra = nn.Linear(32, 32)
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 3)
        self.unused = nn.Linear(4, 4) if unused else None

    def forward(self, x: torch.Tensor, extra: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if extra:
            h = torch.tanh(self.extra(h))
        return self.head(torch.tanh(self.mid(h)))


def _optimizer(name: str, net: Net) -> torch.optim.Optimizer:
    groups = [
        {"params": [*net.body.parameters(), *net.extra.parameters()]},
        {"params": [p for n, p in net.named_parameters() if n.startswith(("mid", "head", "un"))]},
    ]
    if name == "SGD":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)


def _run(rank: int, name: str, ahead: bool, unused: bool) -> tuple[list[Any], int]:
    net = Net(unused)
    model, opt = gradhub.prepare(
        net, _optimizer(name, net), strategy="sharded", bucket_mb=0.002, step_ahead=ahead
    )
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    g = torch.Generator().manual_seed(rank)
    record = []
    for what in PLAN:
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        # Read before the backward: between backward and step it is refused.
        saved = opt.state_dict() if what == "load" else None
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x, extra=rank == 0), y).backward()
        if what == "no step":
            continue
        if what == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif what == "lr":
            for group in opt.param_groups:
                group["lr"] *= 0.5
        elif what == "load":
            opt.load_state_dict(saved)
        opt.step()
        scheduler.step()
        params = [p.detach().clone() for p in net.parameters()]
        state = opt.state_dict()["state"]
        record.append((params, {k: dict(v) for k, v in state.items()}))
    ahead_obj = model.strategy._ahead
    kept = ahead_obj.kept if ahead_obj is not None else 0
    model.close()
    return record, kept


def same_bits_either_way(rank: int, world_size: int, name: str, unused: bool) -> dict[str, Any]:
    """Per step: whether both runs' parameters and state are equal to the bit."""
    runtime = gradhub.init(timeout=60)
    try:
        on, kept = _run(rank, name, True, unused)
        off, _ = _run(rank, name, False, unused)
    finally:
        runtime.close()
    equal = []
    for (p_on, s_on), (p_off, s_off) in zip(on, off, strict=True):
        same = all(torch.equal(a, b) for a, b in zip(p_on, p_off, strict=True))
        same = same and s_on.keys() == s_off.keys()
        for k in s_on:
            for key, value in s_on[k].items():
                other = s_off[k][key]
                same = same and (
                    torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other
                )
        equal.append(same)
    moved = not torch.equal(on[0][0][0], on[-1][0][0])
    return {"equal": equal, "kept": kept, "moved": moved}


def weights_against_backward(rank: int, world_size: int) -> dict[str, Any]:
    """The third step's record under ``sharded``: each block's backward start,
    each all-gather's operation name, start and end."""
    from gradhub.transports.shm import ShmTransport

    log: list[Any] = []
    method = ShmTransport.all_gather

    def recorded(self: Any, op: Any, *args: Any, **kw: Any) -> Any:
        begin = time.monotonic()
        try:
            return method(self, op, *args, **kw)
        finally:
            log.append(("all_gather", op.name, begin, time.monotonic()))

    runtime = gradhub.init(timeout=60)
    base = sleeping_model(log)
    model, opt = gradhub.prepare(
        base, torch.optim.SGD(base.parameters(), lr=0.1), strategy="sharded", bucket_mb=1
    )
    ShmTransport.all_gather = recorded  # type: ignore[method-assign]
    x = torch.ones(2, 1)
    try:
        for _ in range(3):
            log.clear()
            opt.zero_grad(set_to_none=True)
            model(x).sum().backward()
            opt.step()
        return {
            "blocks": BLOCKS,
            "backward": {e[1]: e[2] for e in log if e[0] == "backward"},
            "gathers": [e[1:] for e in log if e[0] == "all_gather"],
            "kept": model.strategy._ahead.kept,
        }
    finally:
        ShmTransport.all_gather = method  # type: ignore[method-assign]
        model.close()
        runtime.close()
