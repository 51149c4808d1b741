"""``gradhub plot RUN_DIR``: draw a run's loss and accuracy curves into a PNG."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plot", help="draw loss/accuracy curves of a run folder (PNG)")
    p.add_argument("run_dir", type=Path, help="folder with metrics.rank*.jsonl (or sub-folders)")
    p.add_argument("-o", "--output", type=Path, help="PNG to write (default RUN_DIR/curves.png)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gradhub.train.plotting import plot_run

    try:
        path = plot_run(args.run_dir, args.output)
    except (ValueError, OSError, ImportError) as exc:
        print(f"gradhub plot: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
