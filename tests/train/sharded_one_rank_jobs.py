"""Jobs of ``test_sharded_one_rank.py``: ``sharded`` in a job of one rank against
the same script's plain torch run.

A world of one sums one gradient with weight 1, so every step must give the
plain run's bits exactly, whatever the script does between steps: each step
of :data:`PLAN` exercises one way of reaching the slice step (a fresh
``.grad`` per step, a gradient accumulated onto the combined one, zeros in
place, a parameter unused in a step, ``no_sync`` accumulation, torch's clip
between backward and step, bf16 parameters).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gradhub

PLAN = [
    "fresh",
    "fresh",
    "accumulate",  # no zero_grad: the backward adds onto the combined gradient
    "zeros",  # zero_grad(set_to_none=False)
    "unused",  # ``extra`` unused: its .grad stays None, its piece is not stepped
    "fresh",
    "no_sync",  # one micro-step inside no_sync, then the synchronising one
    "clip",
    "unused",
    "accumulate",
    "fresh",
]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 16)
        self.extra = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, extra: bool = True) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if extra:
            h = h + torch.tanh(self.extra(h))
        return self.head(h)


def _run(sharded: bool, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    net = Net().to(dtype)
    opt: Any = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    model: Any = net
    if sharded:
        model, opt = gradhub.prepare(net, opt, strategy="sharded", bucket_mb=0.001)
    gen = torch.Generator().manual_seed(1)
    after: list[list[torch.Tensor]] = []

    def backward(extra: bool = True) -> None:
        x = torch.randn(8, 6, generator=gen).to(dtype)
        y = torch.randint(0, 3, (8,), generator=gen)
        F.cross_entropy(model(x, extra).float(), y).backward()

    for what in PLAN:
        if what not in ("accumulate", "zeros"):
            opt.zero_grad(set_to_none=True)
        if what == "zeros":
            opt.zero_grad(set_to_none=False)
        if what == "no_sync":
            context = model.no_sync() if sharded else torch.enable_grad()
            with context:
                backward()
        backward(extra=what != "unused")
        if what == "clip":
            torch.nn.utils.clip_grad_norm_(list(net.parameters()), 0.05)
        opt.step()
        after.append([p.detach().clone() for p in net.parameters()])
    if sharded:
        model.close()
    return after


def same_bits_as_plain(rank: int, world_size: int, dtype: str) -> list[bool]:
    """Per step: whether every parameter holds the plain run's bits."""
    kind = getattr(torch, dtype)
    with gradhub.init():
        mine = _run(True, kind)
    plain = _run(False, kind)
    return [
        all(torch.equal(a, b) for a, b in zip(m, p, strict=True))
        for m, p in zip(mine, plain, strict=True)
    ]
