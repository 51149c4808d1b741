"""``gradhub demo``: train on scikit-learn's bundled digits data, print the results.

Each strategy is one function ``(args) -> DemoRow`` registered in
``STRATEGIES``; ``--strategy`` picks one or more (default: all). The training
itself lives in the library (``gradhub.train``); this module only parses,
calls and prints.

Rows: ``threads`` (worker threads feeding a DistributedGradientsCoordinator,
softmax classifier), then an MLP (64-128-10) trained by
:class:`~gradhub.DataParallelTrainer`: ``single`` (one process, the
reference), and ``allreduce``, ``sharded``, ``ps-async``, ``ps-sync``,
``ps-ssp``, each a real job of ``--workers`` processes started through
torchrun's machinery (:func:`gradhub.cli.launcher.launch`, parameter servers
first for ``ps-*``). Metrics go to JSON lines under the run folder (one
sub-folder per strategy) and the curves to ``curves.png`` there. Wall time
counts process start-up; samples/s counts the training loop only. The MLP
rows train on ``--device`` (default: each worker's GPU where CUDA is
available, else the CPU; more workers than GPUs share them over gloo, see
:func:`gradhub.runtime.pick_backend`); the threads row on the CPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gradhub.errors import GradhubError, RunFolderExistsError


@dataclass(frozen=True)
class DemoRow:
    """One line of the demo's table."""

    strategy: str
    workers: int
    test_accuracy: float
    wall_seconds: float
    detail: str
    samples_per_s: float | None = None
    min_accuracy: float = 0.90


def run_threads(args: argparse.Namespace) -> DemoRow:
    """Worker threads add gradients to a DistributedGradientsCoordinator in real time."""
    from gradhub.demo.threads import ThreadedConfig, train_softmax_threaded

    config = ThreadedConfig(
        workers=args.workers,
        epochs=args.epochs,
        learning_rate=args.learning_rate,
        seed=args.seed,
    )
    result = train_softmax_threaded(config)
    return DemoRow(
        strategy="threads",
        workers=config.workers,
        test_accuracy=result.test_accuracy,
        wall_seconds=result.wall_seconds,
        detail=f"{result.gradients_per_second:,.0f} gradients applied/s",
    )


MLP_MIN_ACCURACY = 0.95
"""Every data-parallel MLP row must reach this test accuracy."""

_PS_MODES = {"ps-async": "async", "ps-sync": "sync", "ps-ssp": "ssp"}


def _run_dir(args: argparse.Namespace) -> Path:
    if args.run_dir is None:
        args.run_dir = Path("runs") / time.strftime("demo-%Y%m%d-%H%M%S")
    path: Path = args.run_dir
    path.mkdir(parents=True, exist_ok=True)
    return path


def _mlp_row(name: str, workers: int, result: dict[str, Any], wall: float) -> DemoRow:
    detail = f"MLP, {result['steps']} steps, training loop {result['wall_time']:.1f}s"
    if result.get("failures"):
        detail += (
            f"; {result['failures']} worker killed, {result['redone']} step(s) redone "
            f"over the {result['world_size']} survivors"
        )
    return DemoRow(
        strategy=name,
        workers=workers,
        test_accuracy=result["eval_accuracy"],
        wall_seconds=wall,
        detail=detail,
        samples_per_s=result["samples_per_s"],
        min_accuracy=MLP_MIN_ACCURACY,
    )


def run_single(args: argparse.Namespace) -> DemoRow:
    """The reference: the same MLP and data in this one process."""
    from gradhub.demo.job import train

    folder = _run_dir(args) / "single"
    begin = time.perf_counter()
    result = train(
        "allreduce",
        run_dir=folder,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.mlp_lr,
        seed=args.seed,
        device=args.device,
    )
    return _mlp_row("single", 1, asdict(result), time.perf_counter() - begin)


def _job(name: str) -> Callable[[argparse.Namespace], DemoRow]:
    def run_job(args: argparse.Namespace) -> DemoRow:
        from gradhub.cli.launcher import LaunchConfig, launch
        from gradhub.ps.server.config import ServerConfig

        folder = _run_dir(args) / name
        mode = _PS_MODES.get(name, "async")
        survive = name == "survive"
        kill = ["--kill-midway"] if survive else []  # one worker, after half the steps
        config = LaunchConfig(
            nproc=args.workers,
            module=True,
            survive=survive,
            target=[
                "gradhub.demo.job",
                f"--strategy={'allreduce' if survive else name}",
                *kill,
                f"--run-dir={folder}",
                f"--epochs={args.epochs}",
                f"--batch-size={args.batch_size}",
                f"--lr={args.mlp_lr}",
                f"--seed={args.seed}",
                f"--device={args.device}",
            ],
            servers=1 if name in _PS_MODES else 0,
            server=ServerConfig(
                optimizer="sgd",
                lr=args.mlp_lr,
                momentum=0.9,
                mode=mode,
                max_staleness=2 if mode == "ssp" else 0,
            ),
        )
        begin = time.perf_counter()
        code = launch(config)
        wall = time.perf_counter() - begin
        result_file = folder / "result.json"
        if code != 0 or not result_file.is_file():
            raise GradhubError(f"the {name} job failed (exit code {code}); see the log above")
        return _mlp_row(name, args.workers, json.loads(result_file.read_text()), wall)

    run_job.__doc__ = f"A {name} job of --workers processes (torchrun underneath)."
    return run_job


STRATEGIES: dict[str, Callable[[argparse.Namespace], DemoRow]] = {
    "threads": run_threads,
    "single": run_single,
    **{
        name: _job(name)
        for name in ("allreduce", "sharded", "ps-async", "ps-sync", "ps-ssp", "survive")
    },
}

MIN_ACCURACY = 0.90


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="train on the bundled digits data set")
    p.add_argument(
        "--strategy",
        action="append",
        choices=list(STRATEGIES),
        help="strategy to run (repeatable; default: all)",
    )
    p.add_argument("--workers", type=int, default=4, help="workers per strategy (default 4)")
    p.add_argument("--epochs", type=int, default=20, help="passes over the data (default 20)")
    p.add_argument("--learning-rate", type=float, default=0.5, help="step size (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="data split and order seed (default 0)")
    p.add_argument(
        "--mlp-lr", type=float, default=0.05, help="MLP step size, SGD momentum 0.9 (default 0.05)"
    )
    p.add_argument("--batch-size", type=int, default=64, help="MLP global batch (default 64)")
    p.add_argument(
        "--run-dir", type=Path, help="folder for metrics and curves (default runs/demo-TIME)"
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        help="where the MLP rows train (default: cuda where CUDA is available, else cpu)",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    # torchrun's default for several local workers, set here so it does not warn per job.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not args.verbose:  # keep the servers' and workers' chatter out of the table
        logging.getLogger("gradhub").setLevel(logging.WARNING)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    names = args.strategy or list(STRATEGIES)
    used = [n for n in names if args.run_dir and any((args.run_dir / n).glob("metrics.rank*"))]
    if used:  # before any row trains; fit would refuse each of them, one job at a time
        raise RunFolderExistsError(
            f"run folder {args.run_dir} already holds the metrics of {', '.join(used)}\n"
            "- help: give a new --run-dir, or leave it out (runs/demo-TIME)"
        )
    rows = [STRATEGIES[name](args) for name in names]
    print(
        f"{'strategy':<10} {'workers':>7} {'test acc':>9} {'wall s':>7} {'samples/s':>10}  detail"
    )
    for r in rows:
        rate = f"{r.samples_per_s:>10,.0f}" if r.samples_per_s is not None else f"{'-':>10}"
        print(
            f"{r.strategy:<10} {r.workers:>7} {r.test_accuracy:>9.2%} "
            f"{r.wall_seconds:>7.2f} {rate}  {r.detail}"
        )
    if args.run_dir is not None and any(args.run_dir.glob("*/metrics.rank*.jsonl")):
        from gradhub.train.plotting import plot_run

        print(f"metrics: {args.run_dir}/*/metrics.rank*.jsonl")
        print(f"curves:  {plot_run(args.run_dir)}")
    failed = [r.strategy for r in rows if r.test_accuracy < r.min_accuracy]
    if failed:
        print(f"below the required test accuracy: {', '.join(failed)}")
        return 1
    return 0
