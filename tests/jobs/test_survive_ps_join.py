"""A replacement joins a surviving job against parameter servers:
``gradhub run -n 4 --survive --max-restarts 1 --servers 1``.

``survive_ps_join_job.py`` (momentum SGD on the server, 16 steps an epoch, 2
epochs): member 2 dies in the backward of step 5; the launcher starts member
4 in its place, and the survivors hold at step 8 until it is ready (so the
short job does not end first). It joins at a step boundary, takes the
servers' values and the job's step count, and the servers count it from its
first push: the job ends with 4 members at 32 committed steps.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gradhub.train.metrics import read_metrics
from survive_checks import STEPS, check_ps_sync, members

JOB = str(Path(__file__).with_name("survive_ps_join_job.py"))
KEYS = 4  # two Linear layers: weight and bias each
KILLED, JOINED = 5, 4  # member 2 dies in step 5; member 4 replaces it


def run_job(out: Path, mode: str) -> int:
    """The job with member 2 killed in step 5 and one replacement; its exit code."""
    cmd = [sys.executable, "-m", "gradhub.cli.main", "run", "-n", "4", "--survive"]
    cmd += ["--max-restarts", "1", "--servers", "1", "--ps-mode", mode, JOB]
    cmd += ["--out", str(out), "--strategy", f"ps-{mode}", "--kill", f"2:{KILLED}:backward"]
    done = subprocess.run([*cmd, "--hold", "8"], capture_output=True, text=True, timeout=400)
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    return done.returncode


def check_members(out: Path) -> tuple[dict[int, dict[str, Any]], int]:
    """Members 0, 1, 3 and 4, their own processes, each at the fault-free steps
    at world size 4 with the same parameters; the step the replacement joined at."""
    found = members(out)
    assert sorted(found) == [0, 1, 3, 4]
    first = found[0]["params"]
    for m in found.values():
        assert m["pid_start"] == m["pid_end"]
        assert m["committed_steps"] == STEPS
        assert m["world_size"] == 4
        for name, value in m["params"].items():
            assert torch.equal(value, first[name]), f"member {m['member']}: {name} differs"
    assert sorted(m["rank"] for m in found.values()) == [0, 1, 2, 3]
    joined = found[JOINED]["result"]
    assert joined["start_step"] >= 8 and joined["steps"] == STEPS
    assert found[JOINED]["failed_steps"] == 0  # it joined at a boundary: no step failed
    generations = [
        (r["members"], r["dead"]) for r in read_metrics(out / "run")[0] if r["kind"] == "membership"
    ]
    assert generations == [([0, 1, 3], [2]), ([0, 1, 3, 4], [])]
    for key, by_worker in found[0]["steps"].items():  # the servers count it from its join
        assert by_worker == {"0": STEPS, "1": STEPS, "2": KILLED, "3": STEPS, "4": STEPS}, key
    return found, joined["start_step"]


@pytest.mark.slow
@pytest.mark.timeout(600)  # a job of 6 processes, and the reference, on a loaded machine
def test_ps_sync_a_replacement_joins_and_takes_the_servers_values(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    """The 4 members end identical and equal to the single process within 1e-5;
    the server made one update per key and step, every step's round whole."""
    out = tmp_path / "job"
    assert run_job(out, "sync") == 0, (tmp_path / "job.log").read_text()
    found, _ = check_members(out)
    check_ps_sync(found, sgd, KEYS * STEPS)


@pytest.mark.slow
@pytest.mark.timeout(600)  # a job of 6 processes on a loaded machine
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_ps_async_a_replacement_joins_and_the_servers_count_it_from_its_join(
    tmp_path: Path, mode: str
) -> None:
    """Under async and ssp each push is applied on its own: 4 workers' pushes per
    key in steps 0-4, the 3 survivors' in the steps until the replacement joined,
    4 again from there; no pull waited for a replacement counted at step 0 (ssp)."""
    out = tmp_path / "job"
    assert run_job(out, mode) == 0, (tmp_path / "job.log").read_text()
    found, start = check_members(out)
    pushes = KILLED * 4 + (start - KILLED) * 3 + (STEPS - start) * 4
    for m in found.values():
        assert m["pushes"]["updates"] == KEYS * pushes, m["pushes"]
        assert m["rounds_applied"] == dict.fromkeys(m["params"], STEPS)
        assert all(torch.isfinite(v).all() for v in m["params"].values())
