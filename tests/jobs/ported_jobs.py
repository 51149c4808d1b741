"""Runs an example script's ``main(argv)`` in each rank (through ``run_ranks``).

The scripts call ``init_process_group`` / ``gradhub.init()`` and
``destroy_process_group()`` themselves, as launched by torchrun; the harness
gives each run fresh processes with torchrun's environment.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import sys
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
    with contextlib.chdir(cwd), contextlib.redirect_stdout(io.StringIO()):
        return module.main(argv)
