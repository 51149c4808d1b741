"""A job for the survival tests: ``gradhub run -n 4 --survive ... survive_job.py``.

A small MLP on synthetic data (made here from a seed: 512 samples of 20
features, 4 classes), SGD with momentum (or AdamW), global batches of 32:
16 steps an epoch. ``--kill MEMBER:STEP:WHERE`` (repeatable) makes worker
``MEMBER`` SIGKILL itself in step ``STEP`` (counted from 0):

- ``backward``: in the middle of the backward, from a gradient hook of the
  first layer's weight (whose gradient comes last), when the other buckets'
  all-reduces are under way (``bucket_mb`` is tiny: one bucket per parameter);
- ``between``: after the step committed (fit's ``on_step``);
- ``exchange``: in the optimizer's step, right after this rank's update (under
  ``sharded``: its slice stepped, before the updated slices are all-gathered);
- ``checkpoint``: half way through writing its checkpoint file of the step
  (with ``--checkpoint-every``; ``STEP`` counts the steps committed);
- ``start``: before it joins the job (``STEP`` is ignored);
- ``rendezvous``: in the first regroup, once every member arrived, inside the
  new process group's own rendezvous (``STEP`` is ignored).

``--hold STEP`` (with ``gradhub run --max-restarts``): from that step on, while
the job is short of workers, ``fit``'s ``on_step`` waits until the replacement
is ready, so that it joins before the job ends.

``--loop``: the user's own loop with :class:`gradhub.GlobalBatchSampler` and
a ``DataLoader`` (``--loader-workers`` of them), instead of ``fit``.
Without ``--survive`` in the launcher (a plain ``python survive_job.py``) it
is the single-process reference on the same global batches.

Every worker that finishes writes ``member-<id>.json`` in ``--out`` (its pid
at the start and at the end, the fit result or the loop's counts, the
committed steps) and ``member-<id>.pt``, its final parameters.
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
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import DataLoader, TensorDataset

import gradhub
from gradhub.runtime import membership

SAMPLES, FEATURES, CLASSES, BATCH = 512, 20, 4, 32


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    w = torch.randn(FEATURES, CLASSES, generator=g)
    return x, (x @ w).argmax(dim=1)


def model_and_optimizer(name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES)
    )
    if name == "adamw":
        return model, torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def kills(specs: list[str], member: int) -> dict[int, str]:
    """Step -> where, for this member."""
    mine = {}
    for spec in specs:
        who, step, where = spec.split(":")
        if int(who) == member:
            mine[int(step)] = where
    return mine


def die(out: Path, member: int) -> None:
    """SIGKILL this worker, noting the time first (``killed-<member>.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"killed-{member}.json").write_text(json.dumps({"time": time.time()}))
    os.kill(os.getpid(), signal.SIGKILL)


def hold_for_replacement(runtime: gradhub.Runtime, workers: int) -> None:
    """While the job is short of workers, wait (at most 120 s) until a
    replacement is ready to join: the next step then takes it in. (A replacement
    starts in seconds, the whole job takes a few: without this the job could
    end before it arrives.)"""
    membership = runtime.membership
    assert membership is not None
    deadline = time.monotonic() + 120
    while runtime.world_size < workers and not membership.pending:
        if time.monotonic() > deadline:
            raise TimeoutError("no replacement joined within 120 s")
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--kill", action="append", default=[])
    p.add_argument("--loop", action="store_true")
    p.add_argument("--loader-workers", type=int, default=0)
    p.add_argument("--hold", type=int, default=0, help="from this step, wait for a replacement")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--workers", type=int, default=4, help="the job's workers (with --hold)")
    p.add_argument("--strategy", default="allreduce")
    args = p.parse_args()
    pid = os.getpid()
    member = int(os.environ.get("GRADHUB_MEMBER", "0"))
    model, optimizer = model_and_optimizer(args.optimizer)
    x, y = data()
    plan = kills(args.kill, member)
    if "start" in plan.values():
        die(args.out, member)
    if "rendezvous" in plan.values():
        arrive = membership.arrive

        def arrive_then_die(ms: membership.Membership, record: membership.Generation) -> None:
            arrive(ms, record)
            if record.number >= 1:
                die(args.out, member)

        membership.arrive = arrive_then_die
    with gradhub.init(timeout=60) as runtime:

        def in_backward(_: torch.Tensor) -> None:
            if plan.get(runtime.committed_steps) == "backward":
                die(args.out, member)

        model[0].weight.register_post_accumulate_grad_hook(in_backward)

        def in_exchange(*_: Any) -> None:  # after any optimizer's step: the first is ours
            if plan.get(runtime.committed_steps) == "exchange":
                die(args.out, member)

        register_optimizer_step_post_hook(in_exchange)
        save = torch.save

        def in_checkpoint(obj: Any, f: Any, *rest: Any, **kw: Any) -> None:
            if isinstance(obj, dict) and plan.get(obj.get("step", -1)) == "checkpoint":
                f.write(b"half a checkpoint")
                f.flush()
                die(args.out, member)
            save(obj, f, *rest, **kw)

        torch.save = in_checkpoint
        out: dict[str, Any] = {"member": member, "pid_start": pid}
        if args.loop:
            out.update(own_loop(model, optimizer, runtime, x, y, args, plan, member))
        else:

            def between(step: int, record: dict[str, Any]) -> None:
                if plan.get(step - 1) == "between":
                    die(args.out, member)
                if args.hold and step >= args.hold:
                    hold_for_replacement(runtime, args.workers)

            with gradhub.DataParallelTrainer(
                model, optimizer, strategy=args.strategy, runtime=runtime, bucket_mb=1e-4
            ) as trainer:
                result = trainer.fit(
                    (x, y),
                    epochs=args.epochs,
                    batch_size=BATCH,
                    run_dir=args.out / "run",
                    progress=False,
                    on_step=between,
                    checkpoint_dir=args.out / "ckpt" if args.checkpoint_every else None,
                    checkpoint_every=args.checkpoint_every,
                )
            out["result"] = {k: v for k, v in asdict(result).items() if k != "history"}
        out.update(
            pid_end=os.getpid(),
            committed_steps=runtime.committed_steps,
            rank=runtime.rank,
            world_size=runtime.world_size,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), args.out / f"member-{member}.pt")
    (args.out / f"member-{member}.json").write_text(json.dumps(out))


def own_loop(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    runtime: gradhub.Runtime,
    x: torch.Tensor,
    y: torch.Tensor,
    args: argparse.Namespace,
    plan: dict[int, str],
    member: int,
) -> dict[str, Any]:
    """The loop a user writes: a prepared model, a global-batch sampler, a loader."""
    dataset = TensorDataset(x, y)
    sampler = gradhub.GlobalBatchSampler(dataset, BATCH, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=args.loader_workers)
    ddp_model, opt = gradhub.prepare(
        model, optimizer, strategy=args.strategy, runtime=runtime, bucket_mb=1e-4
    )
    iterations = 0
    for epoch in range(runtime.committed_steps // len(sampler), args.epochs):  # a replacement's
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            iterations += 1
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp_model(inputs), targets)
            loss.backward()
            opt.step()
            if plan.get(runtime.committed_steps - 1) == "between":
                die(args.out, member)
    return {"iterations": iterations}


if __name__ == "__main__":
    main()
