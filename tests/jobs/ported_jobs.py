"""Runs an example script's ``main(argv)`` in each rank (through ``run_ranks``).

The scripts call ``init_process_group`` / ``gradhub.init()`` and
``destroy_process_group()`` themselves, as launched by torchrun; the harness
gives each run fresh processes with torchrun's environment.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_script(rank: int, world: int, script: str, argv: list[str], cwd: str) -> Any:
    # One torch thread per rank: two ranks share a 2-core machine, and spinning
    # intra-op threads of one rank would stall the other's collectives.
    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES))
    module = importlib.import_module(script)
    reference = "--ddp" in argv
    if reference:
        # Plain DDP on gloo (torch 2.13) hangs in about one run in five when the
        # script's destroy_process_group() comes before its DDP model is freed
        # (the freeing never returns). For the reference run only, the group is
        # destroyed after main() returned, once its objects are gone; the
        # gradhub runs keep the script's own line.
        module.destroy_process_group = lambda: None
    with contextlib.chdir(cwd), contextlib.redirect_stdout(io.StringIO()):
        result = module.main(argv)
    result["group_after_main"] = torch.distributed.is_initialized()
    if reference and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _wait_for_every_rank(Path(cwd), rank, world)
    return result


def _wait_for_every_rank(folder: Path, rank: int, world: int, timeout: float = 60.0) -> None:
    """Return once every rank's ``main`` returned (files, no store).

    Under the harness rank 0 hosts the job's c10d store (under torchrun the
    agent does): if it exited first, another rank still tearing its process
    group down (``destroy_process_group()`` at the end of the script) would
    wait for a store that is gone.
    """
    port = os.environ["MASTER_PORT"]
    (folder / f".done-{port}-{rank}").touch()
    deadline = time.monotonic() + timeout
    while not all((folder / f".done-{port}-{r}").exists() for r in range(world)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks of the job on port {port} did not all finish")
        time.sleep(0.02)
