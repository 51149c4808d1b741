"""The job :mod:`survive` launches: ``gradhub run -n N [--survive] _survive_job.py``.

An MLP (``--widths``, default 512-1024-1024-10: 1.58M parameters) on
synthetic data made here from a seed (``--steps`` global batches of
``--batch`` samples, one epoch), SGD with momentum,
:meth:`gradhub.DataParallelTrainer.fit` with ``--strategy`` (``allreduce`` or
``sharded``; ``--bucket-mb``: the buckets' size). The same script runs with
and without ``--survive``.

``--kill MEMBER:STEP:WHERE`` (repeatable) makes worker ``MEMBER`` SIGKILL
itself in step ``STEP`` (counted from 0), writing ``killed-<member>.json``
(the wall-clock time) just before:

- ``backward``: in the middle of the backward, from a gradient hook of the
  first layer's weight (its gradient comes last: the other buckets'
  all-reduces are under way);
- ``between``: after the step committed (fit's ``on_step``).

Every worker that finishes writes ``member-<id>.json`` in ``--out``: each
committed step's count and wall-clock and ``perf_counter`` times (taken in ``on_step``,
where fit writes its step record), the committed-step count at each forward
(a step a death interrupted is trained twice), the fit result without its
history, and the torch threads it ran with. Under ``sharded`` also, per
step, the time of this rank's own slice's optimizer step
(``ShardedOptimizer.step_pieces``, its publication included) and of the
mirrors' (``Mirror.step``: a surviving job's copies of other ranks' slices),
each timed around the call, and the bytes the mirrors hold (their fp32
weights and optimizer state, as the job ends).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradhub
from gradhub.collective.sharded_optimizer import ShardedOptimizer
from gradhub.train.strategies.sharded_survival import Mirror


def mlp(widths: list[int]) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def data(samples: int, features: int, classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(samples, features, generator=g), torch.randint(
        0, classes, (samples,), generator=g
    )


def plan_of(specs: list[str], member: int) -> dict[int, str]:
    """Step -> where, for this member."""
    mine = {}
    for spec in specs:
        who, step, where = spec.split(":")
        if int(who) == member:
            mine[int(step)] = where
    return mine


def die(out: Path, member: int, committed: int) -> None:
    """SIGKILL this worker, writing first the wall-clock time and the steps it
    saw committed (``killed-<member>.json``)."""
    note = {"time": time.time(), "committed": committed}
    (out / f"killed-{member}.json").write_text(json.dumps(note))
    os.kill(os.getpid(), signal.SIGKILL)


class Timed:
    """Times every call of a method of ``cls`` (``perf_counter`` around it), and
    keeps the objects it was called on."""

    def __init__(self, cls: type, name: str) -> None:
        self.seconds: list[float] = []
        self.holders: dict[int, Any] = {}
        inner = getattr(cls, name)

        def timed(holder: Any, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(holder, *args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - started)
                self.holders[id(holder)] = holder

        setattr(cls, name, timed)


def held_bytes(mirror: Mirror) -> dict[str, int]:
    """A mirror's fp32 weights and its optimizer state, in bytes."""
    state = sum(
        t.numel() * t.element_size()
        for s in mirror.optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    return {"weights": mirror.weights.numel() * 4, "state": state}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--batch", type=int, default=512, help="global batch size")
    p.add_argument("--widths", default="512,1024,1024,10")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--strategy", choices=["allreduce", "sharded"], default="allreduce")
    p.add_argument("--kill", action="append", default=[])
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    member = int(os.environ.get("GRADHUB_MEMBER", os.environ.get("RANK", "0")))
    widths = [int(w) for w in args.widths.split(",")]
    model = mlp(widths)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = data(args.steps * args.batch, widths[0], widths[-1])
    plan = plan_of(args.kill, member)
    steps: list[int] = []
    wall: list[float] = []
    clock: list[float] = []
    forwards: list[int] = []
    own = Timed(ShardedOptimizer, "step_pieces")
    mirrored = Timed(Mirror, "step")
    with gradhub.init(timeout=60) as runtime:

        def in_backward(_: torch.Tensor) -> None:
            if plan.get(runtime.committed_steps) == "backward":
                die(args.out, member, runtime.committed_steps)

        def at_forward(*_: Any) -> None:
            forwards.append(runtime.committed_steps)

        def on_step(step: int, record: dict[str, Any]) -> None:
            steps.append(step)
            wall.append(time.time())
            clock.append(time.perf_counter())
            if plan.get(step - 1) == "between":
                die(args.out, member, step)

        first = model[0]
        assert isinstance(first, nn.Linear)
        first.weight.register_post_accumulate_grad_hook(in_backward)
        model.register_forward_pre_hook(at_forward)
        with gradhub.DataParallelTrainer(
            model, optimizer, strategy=args.strategy, runtime=runtime, bucket_mb=args.bucket_mb
        ) as trainer:
            result = trainer.fit(
                (x, y), epochs=1, batch_size=args.batch, progress=False, on_step=on_step
            )
        report = {
            "member": member,
            "rank": runtime.rank,
            "world_size": runtime.world_size,
            "survive": runtime.survive,
            "threads": torch.get_num_threads(),
            "parameters": sum(q.numel() for q in model.parameters()),
            "result": {k: v for k, v in asdict(result).items() if k != "history"},
            "steps": steps,
            "step_wall": wall,
            "step_clock": clock,
            "forwards": forwards,
            "strategy": args.strategy,
            "own_step_s": own.seconds,
            "mirror_step_s": mirrored.seconds,
            "mirrors": [held_bytes(m) for m in mirrored.holders.values()],
        }
    (args.out / f"member-{member}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
