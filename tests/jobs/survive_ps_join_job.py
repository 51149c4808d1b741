"""A job for the replacement test against parameter servers:
``gradhub run -n 4 --survive --max-restarts 1 --servers 1 ... survive_ps_join_job.py``.

``survive_ps_job.py``'s training (``survive_job.py``'s MLP, data and momentum
SGD, run by the servers; ``fit`` over global batches of 32, 16 steps an
epoch, 2 epochs) with ``--strategy`` one of ``ps-sync``, ``ps-async``,
``ps-ssp``. ``--kill MEMBER:STEP:backward`` makes worker ``MEMBER`` SIGKILL
itself in the backward of step ``STEP``. ``--hold STEP``: from that step on,
while the job is short of workers, ``fit``'s ``on_step`` waits until the
replacement is ready (``survive_job.py``'s ``--hold``), so that it joins
before the short job ends.

Every worker that finishes writes ``member-<id>.json`` (``survive_ps_job.py``'s
report, with ``fit``'s result: a replacement's ``start_step`` is the step it
joined at) and ``member-<id>.pt`` (the servers' values at the end).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import gradhub
from gradhub.train.strategies import make_strategy
from survive_job import BATCH, data, die, hold_for_replacement, kills, model_and_optimizer
from survive_ps_job import finish


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--strategy", default="ps-sync")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--kill", action="append", default=[])
    p.add_argument("--hold", type=int, default=0, help="from this step, wait for a replacement")
    p.add_argument("--workers", type=int, default=4, help="the job's workers (with --hold)")
    args = p.parse_args()
    member = int(os.environ.get("GRADHUB_MEMBER", "0"))
    model, optimizer = model_and_optimizer("sgd")
    x, y = data()
    plan = kills(args.kill, member)
    out: dict[str, Any] = {"member": member, "pid_start": os.getpid()}
    with gradhub.init(timeout=60) as runtime:

        def in_backward(_: torch.Tensor) -> None:
            if plan.get(runtime.committed_steps) == "backward":
                die(args.out, member)

        def between(step: int, record: dict[str, Any]) -> None:
            if args.hold and step >= args.hold:
                hold_for_replacement(runtime, args.workers)

        model[0].weight.register_post_accumulate_grad_hook(in_backward)
        strategy = make_strategy(args.strategy)
        with gradhub.DataParallelTrainer(
            model, optimizer, strategy=strategy, runtime=runtime
        ) as trainer:
            result = trainer.fit(
                (x, y),
                epochs=args.epochs,
                batch_size=BATCH,
                run_dir=args.out / "run",
                progress=False,
                on_step=between,
            )
            out["result"] = {k: v for k, v in asdict(result).items() if k != "history"}
            finish(strategy, runtime, model, out, args.out)


if __name__ == "__main__":
    main()
