"""Coordinator apply throughput beside the machine's own ``a += b`` bandwidth.

Measures, alternating in one run (A, B, C, A, B, C, ...), on one flat fp32
parameter vector (default 25M elements = 100 MB):

- ``a += b``: ``torch.Tensor.add_`` on two such vectors, the machine's
  in-place add bandwidth (the ceiling for applying one gradient).
- ``numpy a += b``: the same in NumPy, for reference.
- ``apply_pending``: gradients queued with ``copy=False``, then applied by
  :meth:`DistributedGradientsCoordinator.apply_pending` in this thread.
- ``thread``: the coordinator's own thread running, gradients added while it
  applies, timed until :meth:`wait_applied` returns: includes the wake-ups
  and ``add_gradients``' finiteness check (one more read of each gradient).

Bandwidth counts the bytes of ``a += b``: read a, read b, write a = 12 bytes
per fp32 element per gradient (``GB/s = 12 * n * gradients / seconds / 1e9``).
Medians over the rounds; the spread is min-max. Writes JSON (``--json``) and a
Markdown table (``--markdown``, also printed).

    python benchmarks/coordinator.py [--elements 25000000] [--rounds 7] [--per-round 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from gradhub import DistributedGradientsCoordinator

BYTES_PER_ELEMENT = 12  # read a, read b, write a (fp32)


def time_torch_add(a: torch.Tensor, b: torch.Tensor, k: int) -> float:
    start = time.perf_counter()
    for _ in range(k):
        a.add_(b, alpha=-1e-9)
    return time.perf_counter() - start


def time_numpy_add(a: np.ndarray, b: np.ndarray, k: int) -> float:
    start = time.perf_counter()
    for _ in range(k):
        a += b
    return time.perf_counter() - start


def time_apply_pending(coord: DistributedGradientsCoordinator, g: torch.Tensor, k: int) -> float:
    for _ in range(k):
        coord.add_gradients(g, copy=False, nonfinite="skip")
    start = time.perf_counter()
    applied = coord.apply_pending()
    elapsed = time.perf_counter() - start
    assert applied == k
    return elapsed


def time_thread(coord: DistributedGradientsCoordinator, g: torch.Tensor, k: int) -> float:
    # Timed end to end: add_gradients' checks (the finiteness check reads each
    # gradient once more, in this thread) plus hand-over and apply.
    coord.start()
    try:
        start = time.perf_counter()
        for _ in range(k):
            coord.add_gradients(g, copy=False, nonfinite="skip")
        coord.wait_applied(timeout=600)
        return time.perf_counter() - start
    finally:
        coord.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=25_000_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=8, help="gradients per timed round")
    parser.add_argument("--json", default="benchmarks/results/coordinator.json")
    parser.add_argument("--markdown", default="benchmarks/results/coordinator.md")
    args = parser.parse_args()

    n, k = args.elements, args.per_round
    a = torch.randn(n)
    b = torch.randn(n)
    an, bn = a.numpy().copy(), b.numpy().copy()
    coord = DistributedGradientsCoordinator("descent", learning_rate=1e-9)
    coord.set_model_parameters(torch.randn(n), copy=False)
    g = torch.randn(n)

    cases: dict[str, Callable[[], float]] = {
        "a += b (torch add_)": lambda: time_torch_add(a, b, k),
        "a += b (numpy)": lambda: time_numpy_add(an, bn, k),
        "coordinator apply_pending": lambda: time_apply_pending(coord, g, k),
        "coordinator thread": lambda: time_thread(coord, g, k),
    }
    for fn in cases.values():  # warm-up: page in every buffer once
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, fn in cases.items():
            seconds[name].append(fn())

    bytes_per_round = BYTES_PER_ELEMENT * n * k
    baseline = statistics.median(seconds["a += b (torch add_)"])
    rows = []
    for name, times in seconds.items():
        med = statistics.median(times)
        rows.append(
            {
                "case": name,
                "median_s_per_round": med,
                "gradients_per_s": k / med,
                "gb_per_s": bytes_per_round / med / 1e9,
                "gb_per_s_min": bytes_per_round / max(times) / 1e9,
                "gb_per_s_max": bytes_per_round / min(times) / 1e9,
                "fraction_of_torch_add": baseline / med,
            }
        )
    report = {
        "elements": n,
        "megabytes": n * 4 / 1e6,
        "gradients_per_round": k,
        "rounds": args.rounds,
        "bytes_per_element": BYTES_PER_ELEMENT,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "results": rows,
    }
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=2)

    lines = [
        f"{n:,} fp32 elements ({n * 4 / 1e6:.0f} MB), {k} gradients per round, "
        f"{args.rounds} rounds, medians; GB/s counts 12 bytes/element (read a, read b, write a); "
        f"{os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} threads",
        "",
        "| case | gradients/s | GB/s (min-max) | vs torch a += b |",
        "| --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['gradients_per_s']:.1f} | {r['gb_per_s']:.2f} "
            f"({r['gb_per_s_min']:.2f}-{r['gb_per_s_max']:.2f}) | "
            f"{r['fraction_of_torch_add']:.0%} |"
        )
    table = "\n".join(lines) + "\n"
    with open(args.markdown, "w") as f:
        f.write(table)
    print(table, end="")


if __name__ == "__main__":
    main()
