"""What the benchmark scripts share: running the ranks, this machine's copy
bandwidth and load, writing the results."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from gradhub.collective import free_loopback_port

RESULTS = Path(__file__).parent / "results"


def rank_zero_result(
    rank_main: Callable[..., None], world_size: int, *args: Any, timeout: float = 3600
) -> Any:
    """Spawn ``rank_main(rank, port, *args, queue)`` for every rank on a free
    127.0.0.1 port and return what rank 0 puts on ``queue``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_loopback_port()
    procs = [
        ctx.Process(target=rank_main, args=(rank, port, *args, queue)) for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    result = queue.get(timeout=timeout)
    for p in procs:
        p.join(60)
    return result


def copy_bandwidth(nbytes: int = 64 << 20, repeats: int = 9) -> dict[str, float]:
    """This machine's one-thread ``copy_`` bandwidth, the unit of every floor.

    GB/s = the bytes a copy reads and writes (``2 * nbytes``) per second
    would double-count what a floor divides; the figure here is ``nbytes``
    copied per second (how the issue's "6 GB/s copy" is quoted), the median
    and min-max of ``repeats`` copies of ``nbytes`` (default 64 MB, twice the
    32 MB last-level cache) between two touched buffers, one torch thread.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.ones(nbytes // 4)
        dst = torch.zeros(nbytes // 4)
        dst.copy_(src)
        rates = []
        for _ in range(repeats):
            begin = time.perf_counter()
            dst.copy_(src)
            rates.append(nbytes / (time.perf_counter() - begin) / 1e9)
    finally:
        torch.set_num_threads(threads)
    return {
        "copy_GBps_median": statistics.median(rates),
        "copy_GBps_min": min(rates),
        "copy_GBps_max": max(rates),
        "copy_bytes": float(nbytes),
    }


def machine_note() -> dict[str, Any]:
    """Copy bandwidth and load average, recorded beside every result so a slower
    (or busier) machine is told apart from a regression."""
    return {"loadavg": list(os.getloadavg()), **copy_bandwidth()}


def spread(samples: list[float]) -> dict[str, float]:
    """Median, min and max of ``samples``."""
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
    }


def write_results(out: str | Path, name: str, report: Any, markdown: str) -> None:
    """``<out>/<name>.json`` and ``<out>/<name>.md`` (the folder is created)."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(report, indent=2))
    (folder / f"{name}.md").write_text(markdown)
