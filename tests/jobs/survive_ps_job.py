"""A job for the parameter-server survival tests:
``gradhub run -n 4 --survive --servers 1 ... survive_ps_job.py``.

``survive_job.py``'s MLP, data and optimizer (SGD with momentum, run by the
servers), global batches of 32: 16 steps an epoch. ``--strategy`` picks
``ps-sync``, ``ps-async`` or ``ps-ssp``. ``--kill MEMBER:STEP:WHERE``
(repeatable) makes worker ``MEMBER`` SIGKILL itself in step ``STEP``
(counted from 0):

- ``backward``: in the middle of the backward (a gradient hook of the first
  layer's weight), before anything of the step reached the servers;
- ``pushing``: after its first push of the step was accepted, before its
  second: under ``ps-sync`` the round of the first key is complete and
  applied once the survivors pushed it, the others miss the dead worker's
  share (a step applied on some keys only);
- ``pushed`` (``ps-sync``): once every push of the step was accepted, before
  the pulls: every round of the step is complete on the servers.

``--loop``: the user's own loop with :class:`gradhub.GlobalBatchSampler`
instead of ``fit`` (``--skip MEMBER:STEP``: with a :class:`gradhub.GradScaler`,
whose gradients overflow on worker ``MEMBER`` alone in step ``STEP``, which
that worker then skips); each worker then appends the sample indices of every
step it committed to ``trained-<member>.jsonl`` (written as it goes, so a
dead worker's committed steps are there too).

Every worker that finishes writes ``member-<id>.json`` (its pid at the start
and at the end, the committed steps, its rank and world size at the end, the
servers' push counters and the server's accounting of each key's steps) and
``member-<id>.pt``, the parameters it holds at the end (pulled from the
servers).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import gradhub
from gradhub.train.strategies import make_strategy
from survive_job import BATCH, data, die, kills, model_and_optimizer


def arm(strategy: Any, plan: dict[int, str], runtime: gradhub.Runtime, out: Path) -> None:
    """Make this worker die where ``plan`` says (``pushing``, ``pushed``): its
    strategy's waits for the servers are wrapped, and its client's pushes from
    the first wait on (the client exists once the strategy is set up)."""
    settle = strategy._settle
    member = runtime.membership.member if runtime.membership is not None else 0
    counted: dict[int, int] = {}

    def wrap(push: Any) -> Any:
        def pushing(*args: Any, **kw: Any) -> Any:
            step = runtime.committed_steps
            if plan.get(step) != "pushing":
                return push(*args, **kw)
            counted[step] = counted.get(step, 0) + 1
            if counted[step] == 2:
                die(out, member)
            future = push(*args, **kw)
            future.result(timeout=60)  # accepted by its server before the next one
            return future

        return pushing

    def settled(futures: list[Any]) -> None:
        if not counted:
            counted[-1] = 0
            strategy._client.push = wrap(strategy._client.push)
        settle(futures)

    pull = strategy._pull_staged

    def pulling() -> None:
        if plan.get(runtime.committed_steps) == "pushed":
            die(out, member)
        pull()

    strategy._settle, strategy._pull_staged = settled, pulling


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--strategy", default="ps-sync")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--kill", action="append", default=[])
    p.add_argument("--loop", action="store_true")
    p.add_argument("--skip", default=None, help="MEMBER:STEP (with --loop)")
    args = p.parse_args()
    pid = os.getpid()
    member = int(os.environ.get("GRADHUB_MEMBER", "0"))
    model, optimizer = model_and_optimizer("sgd")
    x, y = data()
    plan = kills(args.kill, member)
    out: dict[str, Any] = {"member": member, "pid_start": pid}
    with gradhub.init(timeout=60) as runtime:

        def in_backward(_: torch.Tensor) -> None:
            if plan.get(runtime.committed_steps) == "backward":
                die(args.out, member)

        model[0].weight.register_post_accumulate_grad_hook(in_backward)
        strategy = make_strategy(args.strategy)
        arm(strategy, plan, runtime, args.out)
        if args.loop:
            ddp_model, opt = gradhub.prepare(model, optimizer, strategy=strategy, runtime=runtime)
            out.update(own_loop(ddp_model, opt, runtime, x, y, args, member))
            finish(strategy, runtime, model, out, args.out)
        else:
            with gradhub.DataParallelTrainer(
                model, optimizer, strategy=strategy, runtime=runtime
            ) as trainer:
                result = trainer.fit((x, y), epochs=args.epochs, batch_size=BATCH, progress=False)
                out["result"] = {k: v for k, v in asdict(result).items() if k != "history"}
                finish(strategy, runtime, model, out, args.out)


def finish(
    strategy: Any, runtime: gradhub.Runtime, model: torch.nn.Module, out: dict[str, Any], to: Path
) -> None:
    """Write this member's report and parameters (the servers' values)."""
    strategy.refresh()  # the servers' values (ps-async workers end apart)
    reports = strategy._client.stats()
    out.update(
        pid_end=os.getpid(),
        committed_steps=runtime.committed_steps,
        rank=runtime.rank,
        world_size=runtime.world_size,
        failed_steps=strategy.failed_steps,
        pushes={k: sum(r["counters"][k] for r in reports) for k in _COUNTERS},
        applied_by_worker=reports[0]["push_applied_by_worker"],
        # key -> worker -> its pushes in the key's applied steps; key -> applied steps
        steps=reports[0]["steps"],
        rounds_applied=reports[0]["rounds_applied"],
    )
    to.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), to / f"member-{out['member']}.pt")
    (to / f"member-{out['member']}.json").write_text(json.dumps(out))
    # Every survivor has read the servers before any of them leaves (the
    # launcher stops the servers once the workers are done).
    runtime.all_reduce_sum(torch.zeros(1), where="end")


_COUNTERS = ("push_applied", "push_superseded", "updates")


def own_loop(
    ddp_model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    runtime: gradhub.Runtime,
    x: torch.Tensor,
    y: torch.Tensor,
    args: argparse.Namespace,
    member: int,
) -> dict[str, Any]:
    """The loop a user writes, recording the samples of each committed step."""
    dataset = TensorDataset(x, y, torch.arange(len(x)))
    sampler = gradhub.GlobalBatchSampler(dataset, BATCH, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler)
    args.out.mkdir(parents=True, exist_ok=True)
    iterations = 0
    scaler = gradhub.GradScaler(opt) if args.skip else None
    who, when = map(int, args.skip.split(":")) if args.skip else (-1, -1)
    with (args.out / f"trained-{member}.jsonl").open("a") as record:
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            for inputs, targets, index in loader:
                iterations += 1
                before = runtime.committed_steps
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(ddp_model(inputs), targets)
                if scaler is None:
                    loss.backward()
                    opt.step()
                else:
                    if member == who and before == when:
                        loss = loss * float("inf")  # this worker's gradients overflow
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                if runtime.committed_steps > before:
                    entry = {"epoch": epoch, "step": before, "samples": index.tolist()}
                    record.write(json.dumps(entry) + "\n")
                    record.flush()
    return {"iterations": iterations}


if __name__ == "__main__":
    main()
