"""``gradhub demo``: train on scikit-learn's bundled digits data, print the results.

Each strategy is one function ``(args) -> DemoRow`` registered in
``STRATEGIES``; ``--strategy`` picks one or more (default: all). The training
itself lives in the library (``gradhub.train``); this module only parses,
calls and prints.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DemoRow:
    """One line of the demo's table."""

    strategy: str
    workers: int
    test_accuracy: float
    wall_seconds: float
    detail: str


def run_threads(args: argparse.Namespace) -> DemoRow:
    """Worker threads add gradients to a DistributedGradientsCoordinator in real time."""
    from gradhub.train.threaded import ThreadedConfig, train_softmax_threaded

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


STRATEGIES: dict[str, Callable[[argparse.Namespace], DemoRow]] = {"threads": run_threads}

MIN_ACCURACY = 0.90


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="train on the bundled digits data set")
    p.add_argument(
        "--strategy",
        action="append",
        choices=sorted(STRATEGIES),
        help="strategy to run (repeatable; default: all)",
    )
    p.add_argument("--workers", type=int, default=4, help="workers per strategy (default 4)")
    p.add_argument("--epochs", type=int, default=20, help="passes over the data (default 20)")
    p.add_argument("--learning-rate", type=float, default=0.5, help="step size (default 0.5)")
    p.add_argument("--seed", type=int, default=0, help="data split and order seed (default 0)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    rows = [STRATEGIES[name](args) for name in (args.strategy or sorted(STRATEGIES))]
    print(f"{'strategy':<10} {'workers':>7} {'test acc':>9} {'wall s':>7}  detail")
    for r in rows:
        print(
            f"{r.strategy:<10} {r.workers:>7} {r.test_accuracy:>9.2%} "
            f"{r.wall_seconds:>7.2f}  {r.detail}"
        )
    failed = [r.strategy for r in rows if r.test_accuracy < MIN_ACCURACY]
    if failed:
        print(f"below {MIN_ACCURACY:.0%} test accuracy: {', '.join(failed)}")
        return 1
    return 0
