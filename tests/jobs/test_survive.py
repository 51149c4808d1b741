"""Jobs whose survivors never stop: ``gradhub run -n 4 --survive``.

``survive_job.py`` trains a small MLP (16 steps an epoch, 2 epochs) and kills
workers at chosen steps and places. The job must exit 0 with the survivors'
processes the ones it started (each writes its pid at its start and end; a
restarted worker would be a new process with no start record), every
survivor at the fault-free number of committed steps, the survivors'
parameters bit-identical to each other, and equal to a single process's on
the same global batches (and to a fault-free 4-worker run) within 1e-5:
the same global batch is summed over 3 ranks instead of 4 or 1, a
different order of float32 additions (measured differences are about 2e-7
after 32 steps).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gradhub.cli.launcher import LaunchConfig
from gradhub.train.checkpoint import CheckpointDir
from gradhub.train.metrics import read_metrics
from survive_checks import STEPS, check_survivors, members, run_job


@pytest.mark.slow
def test_fit_goes_on_over_the_survivors_of_a_kill_in_the_backward(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    out = tmp_path / "job"
    assert run_job(out, 4, "--kill", "2:5:backward") == 0, (tmp_path / "job.log").read_text()
    check_survivors(out, [0, 1, 3], sgd)
    for m in members(out).values():
        assert (m["result"]["steps"], m["result"]["failures"], m["result"]["redone"]) == (
            STEPS,
            1,
            1,
        )
    # The first step committed after the kill, within 5 s of it (metrics' timestamps).
    killed = json.loads((out / "killed-2.json").read_text())["time"]
    metrics = read_metrics(out / "run")
    # Step 5 was the one killed: the record of step 6 is the first commit after it
    # (step 5's own record may be written just after the kill's time).
    after = [r["time"] for r in metrics[0] if r["kind"] == "step" and r["step"] > 5]
    assert after and after[0] - killed <= 5.0, after[:1]
    membership = [r for r in metrics[0] if r["kind"] == "membership"]
    assert [(r["members"], r["dead"], r["step"]) for r in membership] == [([0, 1, 3], [2], 5)]


@pytest.mark.slow
def test_a_death_inside_a_regroups_rendezvous_costs_seconds_not_the_timeout(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    """Member 2 dies in step 5's backward; member 1 then dies inside the new
    group's own rendezvous (every member had arrived). The rendezvous is bounded
    (RENDEZVOUS, 15 s) and the next generation supersedes it; unbounded, the
    survivors would wait out the job's 60 s timeout there."""
    out = tmp_path / "job"
    code = run_job(out, 4, "--kill", "2:5:backward", "--kill", "1:0:rendezvous")
    assert code == 0, (tmp_path / "job.log").read_text()
    assert (out / "killed-1.json").exists()  # it did die in the rendezvous
    check_survivors(out, [0, 3], sgd)
    killed = json.loads((out / "killed-2.json").read_text())["time"]
    metrics = read_metrics(out / "run")
    # Step 5 was the one killed: the record of step 6 is the first commit after it
    # (step 5's own record may be written just after the kill's time).
    after = [r["time"] for r in metrics[0] if r["kind"] == "step" and r["step"] > 5]
    assert after and after[0] - killed <= 40.0, after[:1]
    membership = [r for r in metrics[0] if r["kind"] == "membership"]
    assert membership[-1]["members"] == [0, 3], membership


@pytest.mark.slow
def test_a_replacement_rejoins_and_takes_the_state_from_the_survivors(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    """``--max-restarts 1``: member 2 dies in step 5; member 4 replaces it, joins
    at a step boundary (the survivors hold at step 8 until it is ready, so that
    the short job does not end first) and takes the parameters and the
    optimizer state from them, not from a file: all 4 end identical."""
    out = tmp_path / "job"
    args = ["--kill", "2:5:backward", "--hold", "8"]
    code = run_job(out, 4, *args, launch=("--max-restarts", "1"))
    assert code == 0, (tmp_path / "job.log").read_text()
    check_survivors(out, [0, 1, 3, 4], sgd, world_size=4)
    joined = members(out)[4]["result"]
    assert joined["start_step"] >= 8 and joined["steps"] == STEPS
    assert not list((out / "run").rglob("*.pt"))  # no checkpoint file was involved
    metrics = read_metrics(out / "run")
    generations = [(r["members"], r["dead"]) for r in metrics[0] if r["kind"] == "membership"]
    assert generations == [([0, 1, 3], [2]), ([0, 1, 3, 4], [])]


@pytest.mark.slow
def test_a_kill_while_writing_a_checkpoint_leaves_the_checkpoints_readable(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    """Member 3 dies before it joins (the others' first group is over the rest).
    Checkpoints every 4 steps; member 1 dies half way through writing its file of
    step 8 (a torn temporary file, never a checkpoint). The survivors go on and
    write their files of the later steps at their new ranks; the latest complete
    checkpoint holds the final parameters."""
    out = tmp_path / "job"
    kills = ["--kill", "1:8:checkpoint", "--kill", "3:0:start"]
    code = run_job(out, 4, "--checkpoint-every", "4", *kills)
    assert code == 0, (tmp_path / "job.log").read_text()
    check_survivors(out, [0, 2], sgd)
    folder = CheckpointDir(path=out / "ckpt", rank=0)
    by_step = folder.ranks_by_step()
    assert by_step[STEPS] == by_step[STEPS - 4] == {0, 1}  # written at the new ranks
    assert folder.latest_complete() == (STEPS, 2)
    state = folder.load(STEPS, rank=1)
    for name, value in state["model"].items():
        assert torch.equal(value, members(out)[0]["params"][name])


@pytest.mark.slow
def test_fewer_survivors_than_min_workers_stop_the_job_naming_the_dead(tmp_path: Path) -> None:
    out = tmp_path / "job"
    code = run_job(out, 3, "--kill", "1:2:backward", launch=("--min-workers", "3"))
    log = (tmp_path / "job.log").read_text()
    assert code == 1, log
    assert "TooFewWorkersError: worker(s) 1 died and 2 worker(s) are left" in log
    assert not list(out.glob("member-*.json"))  # no survivor finished


def test_survive_refuses_what_it_does_not_cover_before_anything_starts(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    # a replacement joins a job with servers too (tests/jobs/test_survive_ps_join.py)
    LaunchConfig(nproc=2, target=[str(script)], survive=True, servers=1, max_restarts=1)
    with pytest.raises(ValueError, match="--min-workers must be in"):
        LaunchConfig(nproc=2, target=[str(script)], survive=True, min_workers=3)
    with pytest.raises(ValueError, match="add --survive"):
        LaunchConfig(nproc=2, target=[str(script)], min_workers=2)
