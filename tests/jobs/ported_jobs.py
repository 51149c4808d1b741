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

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def run_script(rank: int, world: int, script: str, argv: list[str], cwd: str) -> Any:
    sys.path.insert(0, str(EXAMPLES))
    module = importlib.import_module(script)
    with contextlib.chdir(cwd), contextlib.redirect_stdout(io.StringIO()):
        return module.main(argv)
