"""Closing a job's runtime lets go of its process group while the interpreter lives.

A gloo group still alive at interpreter exit can abort the process ("terminate
called without an active exception"): its threads free their last operation's
tensors under the GIL, which finalization no longer gives. Closing must leave
nothing holding the group, torch's lazily imported modules included, so the job
runs in fresh interpreters (``gradhub run``), as a user's does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).with_name("close_job.py")


@pytest.mark.timeout(240)
def test_close_leaves_nothing_holding_the_process_group(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "gradhub.cli.main", "run", "-n", "2", str(JOB), str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout + done.stderr
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results == [{"total": 2.0, "alive": False}] * 2
