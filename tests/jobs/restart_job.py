"""A digits job for the restart tests: ``gradhub run --max-restarts 1 ... restart_job.py``.

On the first attempt (torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0) rank
``--kill-rank`` SIGKILLs itself right after step ``--kill-step``: its pushes of
that step are acknowledged and its step record is written, nothing is in
flight. torchrun then restarts every worker and ``fit`` resumes.

``--data`` is a file of ``torch.save((x_train, y_train, x_test, y_test))``
(the digits split the test process made once: importing scikit-learn in every
worker of every attempt would cost more than the training).

Rank 0 writes ``result.json`` in ``--out``: the fit result, and under ``ps-*``
the servers' report (read after ``fit``, whose last evaluation is a collective
that every rank enters only after its last push); and ``final.pt``, the final
parameters.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import gradhub
from gradhub.demo.job import make_mlp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", required=True)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--kill-step", type=int, default=0, help="0: no fault")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    x_train, y_train, x_test, y_test = torch.load(args.data)
    model = make_mlp(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    with gradhub.init(timeout=30) as runtime:

        def fault(step: int, record: dict[str, Any]) -> None:
            first = runtime.restart == 0
            if first and runtime.rank == args.kill_rank and step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)

        options = {"timeout": 30.0} if args.strategy.startswith("ps-") else {}
        with gradhub.DataParallelTrainer(
            model, optimizer, strategy=args.strategy, runtime=runtime, **options
        ) as trainer:
            result = trainer.fit(
                (x_train, y_train),
                eval_data=(x_test, y_test),
                epochs=args.epochs,
                batch_size=64,
                run_dir=args.out / "run",
                progress=False,
                on_step=fault,
            )
            out: dict[str, Any] = {"result": asdict(result)}
            if runtime.is_main and args.strategy.startswith("ps-"):
                from gradhub.train.strategies.ps import published_addresses

                with gradhub.RemoteParameterServer(
                    published_addresses(), worker_id=1000, timeout=30
                ) as ps:
                    out["servers"] = ps.stats()
        if runtime.is_main:
            torch.save(model.state_dict(), args.out / "final.pt")
            (args.out / "result.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
