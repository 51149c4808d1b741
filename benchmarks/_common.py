"""What the benchmark scripts share: running the ranks, writing the results."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def write_results(out: str | Path, name: str, report: Any, markdown: str) -> None:
    """``<out>/<name>.json`` and ``<out>/<name>.md`` (the folder is created)."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(report, indent=2))
    (folder / f"{name}.md").write_text(markdown)
