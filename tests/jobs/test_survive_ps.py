"""Surviving jobs against parameter servers: ``gradhub run -n 4 --survive --servers 1``.

``survive_ps_job.py`` trains ``survive_job.py``'s MLP (16 steps an epoch, 2
epochs) with the optimizer on the server and kills a worker at a chosen step
and place. The job must exit 0 with the survivors' processes the ones it
started (each writes its pid at its start and end), every survivor at the
fault-free number of committed steps and holding the servers' values.

ps-sync: the parameters equal a single process's on the same global batches
within 1e-5 (the same global batch summed over 3 workers instead of 1: a
different order of float32 additions, measured about 2e-7 after 32 steps),
and the server made exactly one update per key and step (4 keys, 32 steps):
no round mixed the dead worker's push with the redo, none was applied twice.

ps-async, ps-ssp: every sample of both epochs is in exactly one share of a
step some worker committed (the dead worker's committed steps included), and
the server applied each share once: every key applied each of the 32 steps
once, from one membership's pushes, whole (the old one's 4, or the
survivors' 3 for the steps from the failed one on), and made no other
update.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from survive_checks import STEPS, check_ps_sync, members
from survive_job import SAMPLES

JOB = str(Path(__file__).with_name("survive_ps_job.py"))
KEYS = 4  # two Linear layers: weight and bias each


def run_job(out: Path, mode: str, *args: str) -> int:
    """``gradhub run -n 4 --survive --servers 1`` of the job; its exit code."""
    cmd = [sys.executable, "-m", "gradhub.cli.main", "run", "-n", "4", "--survive"]
    cmd += ["--servers", "1", "--ps-mode", mode, JOB, "--out", str(out)]
    done = subprocess.run(
        [*cmd, "--strategy", f"ps-{mode}", *args], capture_output=True, text=True, timeout=400
    )
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    return done.returncode


def check_survivors(out: Path, survivors: list[int]) -> dict[int, dict[str, Any]]:
    """Pids kept, every survivor at the fault-free steps with the servers' values."""
    found = members(out)
    assert sorted(found) == survivors
    first = found[survivors[0]]["params"]
    for m in found.values():
        assert m["pid_start"] == m["pid_end"]
        assert m["committed_steps"] == STEPS
        assert m["world_size"] == len(survivors)
        for name, value in m["params"].items():
            assert torch.equal(value, first[name]), f"member {m['member']}: {name} differs"
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)  # a job of 5 processes, and the reference, on a loaded machine
def test_ps_sync_fit_goes_on_over_the_survivors_of_a_kill_in_the_backward(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    out = tmp_path / "job"
    assert run_job(out, "sync", "--kill", "2:5:backward") == 0, (tmp_path / "job.log").read_text()
    found = check_survivors(out, [0, 1, 3])
    check_ps_sync(found, sgd, KEYS * STEPS, failed_steps=1)
    assert all(m["result"]["redone"] == 1 for m in found.values())


@pytest.mark.slow
@pytest.mark.timeout(600)  # a job of 5 processes, and the reference, on a loaded machine
def test_ps_sync_a_step_the_servers_applied_on_some_keys_is_completed_once(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    """Member 2 dies after its push of the first key was accepted: that key's round
    completes with the survivors' pushes and is applied, the others wait for the
    dead worker's share. The survivors train the step again; the server applies
    the redo on the other keys and ignores it on the first (or, where a
    survivor's push of the failed step arrived after the new membership,
    ignores that push and applies the redo on every key)."""
    out = tmp_path / "job"
    assert run_job(out, "sync", "--kill", "2:5:pushing") == 0, (tmp_path / "job.log").read_text()
    found = check_survivors(out, [0, 1, 3])
    check_ps_sync(found, sgd, KEYS * STEPS, failed_steps=1)
    assert all(m["pushes"]["push_superseded"] >= 1 for m in found.values())


@pytest.mark.slow
@pytest.mark.timeout(600)  # a job of 5 processes, and the reference, on a loaded machine
def test_ps_sync_own_loop_survives_a_death_once_every_round_was_complete(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    """Member 1 dies once all its pushes of step 9 were accepted, before its pulls:
    every round of the step is complete. A survivor that got its pulls answered
    first committed the step; one that saw the death first redoes it, and the
    server ignores the redo (the step is applied): either way once."""
    out = tmp_path / "job"
    code = run_job(out, "sync", "--kill", "1:9:pushed", "--loop")
    assert code == 0, (tmp_path / "job.log").read_text()
    found = check_survivors(out, [0, 2, 3])
    check_ps_sync(found, sgd, KEYS * STEPS)


@pytest.mark.slow
@pytest.mark.timeout(600)  # a job of 5 processes, and the reference, on a loaded machine
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_ps_async_survivors_take_over_the_dead_workers_share(tmp_path: Path, mode: str) -> None:
    """Member 3 dies between two pushes of step 7: after its push of the first key
    (``0.weight``), before the second. Its share of that step, and of every
    later one, is trained by the survivors: each sample of both epochs is in
    one share of a step some worker committed (under ssp no pull waits for the
    dead worker: the job ends). The first key applies step 7 once: the four
    first pushes (when the survivors' arrived before the new membership) or
    the survivors' redo; the other keys apply the redo alone."""
    out = tmp_path / "job"
    code = run_job(out, mode, "--kill", "3:7:pushing", "--loop")
    assert code == 0, (tmp_path / "job.log").read_text()
    found = check_survivors(out, [0, 1, 2])
    trained: dict[int, list[int]] = {0: [], 1: []}
    shares: dict[int, list[int]] = {}
    for path in out.glob("trained-*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            trained[entry["epoch"]] += entry["samples"]
            shares.setdefault(entry["step"], []).append(len(entry["samples"]))
    assert len(list(out.glob("trained-*.jsonl"))) == 4  # the dead worker's too
    assert {step: len(n) for step, n in shares.items()} == {
        step: 4 if step < 7 else 3 for step in range(STEPS)
    }
    for epoch, samples in trained.items():
        assert sorted(samples) == list(range(SAMPLES)), f"epoch {epoch}: lost or twice"
    for m in found.values():
        assert all(torch.isfinite(v).all() for v in m["params"].values())
        check_applied_once(m)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ps_async_a_step_one_worker_skips_keeps_the_workers_in_step(tmp_path: Path) -> None:
    """Worker 1's gradients overflow in step 3 (a GradScaler; ps-async decides per
    worker): it skips that step alone, and its skip still ends the step with the
    others, so the job's collectives stay paired and every worker ends at the
    same committed steps with the servers' values."""
    out = tmp_path / "job"
    code = run_job(out, "async", "--loop", "--skip", "1:3")
    assert code == 0, (tmp_path / "job.log").read_text()
    found = check_survivors(out, [0, 1, 2, 3])
    for m in found.values():
        assert all(torch.isfinite(v).all() for v in m["params"].values())


def check_applied_once(m: dict[str, Any]) -> None:
    """The server's accounting after member 3 died in step 7 between its first and
    second push: every key applied each step once, with one push per worker
    of the step's membership, and the server made no other update."""
    steps, applied = m["steps"], m["rounds_applied"]
    assert sorted(steps) == sorted(m["params"]) and len(steps) == KEYS
    for key, by_worker in steps.items():
        first = 8 if key == "0.weight" else 7  # 0.weight: step 7 of the old membership?
        assert by_worker in (
            {"0": STEPS, "1": STEPS, "2": STEPS, "3": 7},
            {"0": STEPS, "1": STEPS, "2": STEPS, "3": first},
        ), f"{key}: pushes applied per worker {by_worker}"
        assert applied.get(key) == STEPS, f"{key}: {applied.get(key)} steps applied"
    counted = sum(n for by_worker in steps.values() for n in by_worker.values())
    assert m["pushes"]["updates"] == counted, m["pushes"]
