"""``strategy="diloco"`` under ``gradhub run -n 4 --survive``: a dead worker drops
out of the next average, and nothing else changes.

``survive_diloco_job.py`` (inner_steps 4, 32 steps) loses member 2 between
syncs (after step 6: the survivors go on with inner steps 7 and 8 and meet
the death in the sync of step 8) and member 1 in the sync of step 12 (right
after its exchange started).

The reference is stated, not replayed: the job must exit 0, the survivors'
processes must be the ones it started, every survivor at the fault-free 32
committed steps (a sync's step stays committed: none is trained again), the
membership records in order, and the survivors' final weights bit-identical
to each other (every survivor takes the same outer step on the same bits).
The loss must be sane: the final model's loss on the 512 samples below 0.7
(it starts near 1.4; a run with both deaths measured 0.37). A bit-exact
replay is not asserted because the run has two correct outcomes: member 1's
pseudo-gradient may have reached every survivor before it died (then that
sync is complete with it, and the death is met at the next sync, step 16)
or not (the sync of step 12 is redone over the survivors); which one is up
to the scheduler.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradhub.train.metrics import read_metrics
from survive_checks import members
from survive_job import data

JOB = str(Path(__file__).with_name("survive_diloco_job.py"))


def run_job(out: Path, workers: int, *args: str, launch: tuple[str, ...] = ()) -> int:
    cmd = [sys.executable, "-m", "gradhub.cli.main", "run", "-n", str(workers), "--survive"]
    done = subprocess.run(
        [*cmd, *launch, JOB, "--out", str(out), *args], capture_output=True, text=True, timeout=300
    )
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    return done.returncode


@pytest.mark.slow
def test_diloco_goes_on_over_the_survivors_of_deaths_between_and_in_syncs(tmp_path: Path) -> None:
    out = tmp_path / "job"
    kills = ["--kill", "2:5:between", "--kill", "1:11:sync"]
    assert run_job(out, 4, *kills) == 0, (tmp_path / "job.log").read_text()
    found = members(out)
    assert sorted(found) == [0, 3]
    first = found[0]["params"]
    for m in found.values():
        assert m["pid_start"] == m["pid_end"]
        assert m["committed_steps"] == 32
        assert (m["world_size"], m["result"]["failures"], m["result"]["redone"]) == (2, 2, 0)
        for name, value in m["params"].items():
            assert torch.equal(value, first[name]), f"member {m['member']}: {name} differs"
    assert sorted(m["rank"] for m in found.values()) == [0, 1]
    metrics = read_metrics(out / "run")
    records = [
        (r["members"], r["dead"], r["step"]) for r in metrics[0] if r["kind"] == "membership"
    ]
    assert records[0] == ([0, 1, 3], [2], 8), records
    assert records[1][:2] == ([0, 3], [1]) and records[1][2] in (12, 16), records
    assert len(records) == 2
    assert json.loads((out / "killed-1.json").read_text())["time"] > 0
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    model.load_state_dict(first)
    x, y = data()
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(x), y).item()
    assert loss < 0.7, loss


@pytest.mark.slow
def test_a_replacement_joins_after_a_sync_and_takes_the_survivors_state(tmp_path: Path) -> None:
    """``--max-restarts 1``: member 2 dies after step 6 (met at the sync of step 8);
    member 4 replaces it. The survivors hold from step 8 until it is ready; the
    tally of the next sync (step 12) says a newer membership is out, every rank
    regroups after that sync and the replacement takes rank 0's state (not a
    file): all 4 end at 32 committed steps, bit-identical."""
    out = tmp_path / "job"
    args = ["--kill", "2:5:between", "--hold", "8"]
    code = run_job(out, 4, *args, launch=("--max-restarts", "1"))
    assert code == 0, (tmp_path / "job.log").read_text()
    found = members(out)
    assert sorted(found) == [0, 1, 3, 4]
    first = found[0]["params"]
    for m in found.values():
        assert (m["pid_start"], m["committed_steps"], m["world_size"]) == (m["pid_end"], 32, 4)
        for name, value in m["params"].items():
            assert torch.equal(value, first[name]), f"member {m['member']}: {name} differs"
    joined = found[4]["result"]
    assert joined["start_step"] >= 8 and joined["start_step"] % 4 == 0, joined
    metrics = read_metrics(out / "run")
    generations = [(r["members"], r["dead"]) for r in metrics[0] if r["kind"] == "membership"]
    assert generations == [([0, 1, 3], [2]), ([0, 1, 3, 4], [])]
