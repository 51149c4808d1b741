"""A selection of torch's own distributed suite on the gradhub backend.

The full list (gloo and gradhub side by side) is ``make test-torch-dist``
(:mod:`torch_dist_suite`). These two, inside the normal suite's budget, cover
DDP (all-reduce on the transports, broadcast) and the transports' all-gather;
every operation, those that run on the inner gloo group included, is checked
against gloo in ``test_backend_operations.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SELECTION = [
    "test_DistributedDataParallelCPU",
    "test_all_gather_coalesced_simple",
]


@pytest.mark.slow
def test_torch_distributed_suite_selection(tmp_path: Path) -> None:
    suite = Path(__file__).with_name("torch_dist_suite.py")
    env = {**os.environ, "BACKEND": "gradhub", "WORLD_SIZE": "2", "TEMP_DIR": str(tmp_path)}
    case = f"{suite}::TestDistBackendWithSpawnGRADHUB::"
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:warnings"]
    command += ["-p", "no:cacheprovider", *(case + name for name in SELECTION)]
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=280, check=False
    )
    done = [line for line in proc.stdout.splitlines() if line.startswith("PASSED")]
    passed = {n for n in SELECTION if any(line.endswith(f"::{n}") for line in done)}
    assert passed == set(SELECTION), proc.stdout[-4000:] + proc.stderr[-2000:]
