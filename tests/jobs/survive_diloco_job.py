"""A job for the diloco survival tests: ``gradhub run -n 4 --survive ... survive_diloco_job.py``.

``survive_job.py``'s data and model (512 samples, global batches of 32: 16
steps an epoch, 2 epochs), trained by ``fit`` under ``strategy="diloco"``
with ``inner_steps=4`` (a sync at every 4th step; inner AdamW, the default
outer Nesterov SGD). ``--kill MEMBER:STEP:WHERE`` (repeatable) makes worker
``MEMBER`` SIGKILL itself in step ``STEP`` (counted from 0):

- ``between``: after the step committed (fit's ``on_step``); pick a step
  that is not a sync's, so the survivors go on with local inner steps and
  meet the death at the next sync;
- ``sync``: in the sync of that step (``STEP + 1`` a multiple of 4), right
  after its exchange started: its pseudo-gradient may be partly or wholly
  on the way when it dies.

``--hold STEP`` (with ``gradhub run --max-restarts``): from that step on, while
the job is short of workers, ``on_step`` waits until the replacement is ready
(``survive_job.hold_for_replacement``); it joins after the next sync.

Every worker that finishes writes ``member-<id>.json`` in ``--out`` (its pid
at the start and at the end, the fit result, the committed steps, its rank
and the world size) and ``member-<id>.pt``, its final parameters.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import gradhub
from gradhub.train.strategies.diloco import exchange
from survive_job import BATCH, data, die, hold_for_replacement, kills, model_and_optimizer

INNER_STEPS = 4


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--kill", action="append", default=[])
    p.add_argument("--hold", type=int, default=0, help="from this step, wait for a replacement")
    args = p.parse_args()
    pid = os.getpid()
    member = int(os.environ.get("GRADHUB_MEMBER", "0"))
    model, optimizer = model_and_optimizer("adamw")
    x, y = data()
    plan = kills(args.kill, member)
    with gradhub.init(timeout=60) as runtime:
        start = exchange.start

        def in_sync(*a: Any, **kw: Any) -> exchange.Exchange:
            job = start(*a, **kw)
            if plan.get(runtime.committed_steps - 1) == "sync":  # this step's sync
                die(args.out, member)
            return job

        exchange.start = in_sync

        def between(step: int, record: dict[str, Any]) -> None:
            if plan.get(step - 1) == "between":
                die(args.out, member)
            if args.hold and step >= args.hold:
                hold_for_replacement(runtime, 4)

        with gradhub.DataParallelTrainer(
            model, optimizer, strategy="diloco", runtime=runtime, inner_steps=INNER_STEPS
        ) as trainer:
            result = trainer.fit(
                (x, y),
                epochs=args.epochs,
                batch_size=BATCH,
                run_dir=args.out / "run",
                progress=False,
                on_step=between,
            )
        out = {
            "member": member,
            "pid_start": pid,
            "pid_end": os.getpid(),
            "result": {k: v for k, v in asdict(result).items() if k != "history"},
            "committed_steps": runtime.committed_steps,
            "rank": runtime.rank,
            "world_size": runtime.world_size,
        }
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), args.out / f"member-{member}.pt")
    (args.out / f"member-{member}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
