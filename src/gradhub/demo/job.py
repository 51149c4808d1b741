"""One process of a ``gradhub demo`` job: ``python -m gradhub.demo.job ...``.

``gradhub demo`` starts this module on every worker through
:func:`gradhub.cli.launcher.launch` (torchrun underneath), once per strategy.
It trains a small MLP on scikit-learn's digits with
:class:`~gradhub.DataParallelTrainer` on ``--device`` (``cuda``: the GPU
``LOCAL_RANK`` picks); rank 0 writes the result as
``result.json`` in the run folder, which the demo reads for its table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from dataclasses import asdict
from pathlib import Path

import torch

import gradhub
from gradhub.demo.threads import load_digits_split


def make_mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def train(
    strategy: str,
    *,
    run_dir: Path,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
    progress: bool = True,
    device: str = "cpu",
    kill_midway: bool = False,
) -> gradhub.FitResult:
    """Train the digits MLP with ``strategy`` in this process of the job, on
    ``device`` (``"cpu"`` or ``"cuda"``). ``kill_midway`` (a surviving job,
    ``gradhub run --survive``): the last worker SIGKILLs itself in the
    middle of the backward of the step half way through."""
    x_train, y_train, x_test, y_test = load_digits_split(0.2, seed)
    model = make_mlp(seed)
    with gradhub.init(timeout=60) as runtime:
        model.to(runtime.local_device(device))
        # ps-* strategies use the servers' optimizer; the others this one.
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        if kill_midway:
            _kill_in_backward(runtime, model, epochs * -(-len(x_train) // batch_size) // 2)
        with gradhub.DataParallelTrainer(
            model, optimizer, strategy=strategy, runtime=runtime
        ) as trainer:
            result = trainer.fit(
                (x_train, y_train),
                eval_data=(x_test, y_test),
                epochs=epochs,
                batch_size=batch_size,
                seed=seed,
                run_dir=run_dir,
                progress=progress,
            )
        if runtime.is_main:
            (Path(run_dir) / "result.json").write_text(json.dumps(asdict(result)))
    return result


def _kill_in_backward(runtime: gradhub.Runtime, model: torch.nn.Module, step: int) -> None:
    """Make the last worker of a surviving job SIGKILL itself in the middle of
    the backward of step ``step`` (counted from 0): a gradient hook on the
    first layer's weight, whose gradient comes last, while the other
    gradients' all-reduces are under way."""
    membership = runtime.membership
    if membership is None or membership.member != runtime.world_size - 1:
        return

    def kill(_: torch.Tensor) -> None:
        if runtime.committed_steps == step:
            os.kill(os.getpid(), signal.SIGKILL)

    next(model.parameters()).register_post_accumulate_grad_hook(kill)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gradhub.demo.job")
    p.add_argument("--strategy", required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--kill-midway", action="store_true", help="surviving job: kill one worker")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    train(
        args.strategy,
        run_dir=args.run_dir,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        progress=not args.no_progress,
        device=args.device,
        kill_midway=args.kill_midway,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
