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
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import readme_blocks
from gradhub.cli.launcher import LaunchConfig
from gradhub.train.checkpoint import CheckpointDir
from gradhub.train.metrics import read_metrics

JOB = str(Path(__file__).with_name("survive_job.py"))
STEPS = 32
TOLERANCE = 1e-5


def _run(out: Path, workers: int, *args: str, launch: tuple[str, ...] = ()) -> int:
    """``gradhub run -n workers --survive`` of the job; its exit code."""
    cmd = [sys.executable, "-m", "gradhub.cli.main", "run", "-n", str(workers), "--survive"]
    done = subprocess.run(
        [*cmd, *launch, JOB, "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    return done.returncode


def _reference(out: Path, *args: str) -> dict[str, torch.Tensor]:
    """One process (no launcher: a job of one rank) on the same global batches."""
    subprocess.run([sys.executable, JOB, "--out", str(out), *args], check=True, timeout=300)
    state: dict[str, torch.Tensor] = torch.load(out / "member-0.pt")
    return state


def _members(out: Path) -> dict[int, dict[str, Any]]:
    found = {}
    for path in sorted(out.glob("member-*.json")):
        report = json.loads(path.read_text())
        report["params"] = torch.load(out / f"member-{report['member']}.pt")
        found[report["member"]] = report
    return found


def _check_survivors(
    out: Path, survivors: list[int], want: dict[str, torch.Tensor], world_size: int = 0
) -> None:
    members = _members(out)
    assert sorted(members) == survivors
    first = members[survivors[0]]["params"]
    for m in members.values():
        assert m["pid_start"] == m["pid_end"]
        assert m["committed_steps"] == STEPS
        assert m["world_size"] == (world_size or len(survivors))
        for name, value in m["params"].items():
            assert torch.equal(value, first[name]), f"member {m['member']}: {name} differs"
    for name, value in first.items():
        diff = (value - want[name]).abs().max().item()
        assert diff <= TOLERANCE, f"{name}: {diff:.2e} from the single process"
    ranks = sorted(m["rank"] for m in members.values())
    assert ranks == list(range(len(survivors)))  # dense, in the old order:
    assert [m["rank"] for _, m in sorted(members.items())] == ranks


@pytest.fixture(scope="module")
def sgd(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    return _reference(tmp_path_factory.mktemp("reference-sgd"))


@pytest.fixture(scope="module")
def adamw(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    return _reference(tmp_path_factory.mktemp("reference-adamw"), "--optimizer", "adamw")


@pytest.mark.slow
def test_fit_goes_on_over_the_survivors_of_a_kill_in_the_backward(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    out = tmp_path / "job"
    assert _run(out, 4, "--kill", "2:5:backward") == 0, (tmp_path / "job.log").read_text()
    _check_survivors(out, [0, 1, 3], sgd)
    for m in _members(out).values():
        assert (m["result"]["steps"], m["result"]["failures"], m["result"]["redone"]) == (
            STEPS,
            1,
            1,
        )
    # The first step committed after the kill, within 5 s of it (metrics' timestamps).
    killed = json.loads((out / "killed-2.json").read_text())["time"]
    metrics = read_metrics(out / "run")
    after = [r["time"] for r in metrics[0] if r["kind"] == "step" and r["time"] > killed]
    assert after and after[0] - killed <= 5.0, after[:1]
    membership = [r for r in metrics[0] if r["kind"] == "membership"]
    assert [(r["members"], r["dead"], r["step"]) for r in membership] == [([0, 1, 3], [2], 5)]


@pytest.mark.slow
def test_own_loop_survives_two_kills_one_of_rank_0(
    tmp_path: Path, adamw: dict[str, torch.Tensor]
) -> None:
    """AdamW, the user's loop with GlobalBatchSampler (no loader workers): rank 0
    dies after step 3 committed, member 2 (then rank 1) in step 9's backward."""
    out = tmp_path / "job"
    kills = ["--kill", "0:3:between", "--kill", "2:9:backward"]
    code = _run(out, 4, "--loop", "--optimizer", "adamw", *kills)
    assert code == 0, (tmp_path / "job.log").read_text()
    _check_survivors(out, [1, 3], adamw)
    for m in _members(out).values():
        assert m["iterations"] == STEPS + 2  # steps 4 and 9 trained twice, nothing lost


@pytest.mark.slow
def test_own_loop_with_a_prefetching_loader_survives(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    """DataLoader(num_workers=2) asks for 4 shares ahead: those fetched before the
    regroup are trained locally and never applied; the same global batch follows."""
    out = tmp_path / "job"
    code = _run(out, 4, "--loop", "--loader-workers", "2", "--kill", "3:7:backward")
    assert code == 0, (tmp_path / "job.log").read_text()
    _check_survivors(out, [0, 1, 2], sgd)


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
    code = _run(out, 4, *args, launch=("--max-restarts", "1"))
    assert code == 0, (tmp_path / "job.log").read_text()
    _check_survivors(out, [0, 1, 3, 4], sgd, world_size=4)
    joined = _members(out)[4]["result"]
    assert joined["start_step"] >= 8 and joined["steps"] == STEPS
    assert not list((out / "run").rglob("*.pt"))  # no checkpoint file was involved
    metrics = read_metrics(out / "run")
    generations = [(r["members"], r["dead"]) for r in metrics[0] if r["kind"] == "membership"]
    assert generations == [([0, 1, 3], [2]), ([0, 1, 3, 4], [])]


@pytest.mark.slow
def test_a_kill_while_writing_a_checkpoint_leaves_the_checkpoints_readable(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    """Checkpoints every 4 steps; member 1 dies half way through writing its file of
    step 8 (a torn temporary file, never a checkpoint). The survivors go on and
    write their files of the later steps at their new ranks; the latest complete
    checkpoint holds the final parameters."""
    out = tmp_path / "job"
    code = _run(out, 4, "--checkpoint-every", "4", "--kill", "1:8:checkpoint")
    assert code == 0, (tmp_path / "job.log").read_text()
    _check_survivors(out, [0, 2, 3], sgd)
    folder = CheckpointDir(path=out / "ckpt", rank=0)
    by_step = folder.ranks_by_step()
    assert by_step[STEPS] == by_step[STEPS - 4] == {0, 1, 2}  # written at the new ranks
    assert folder.latest_complete() == (STEPS, 3)
    state = folder.load(STEPS, rank=1)
    for name, value in state["model"].items():
        assert torch.equal(value, _members(out)[0]["params"][name])


@pytest.mark.slow
def test_fewer_survivors_than_min_workers_stop_the_job_naming_the_dead(tmp_path: Path) -> None:
    out = tmp_path / "job"
    code = _run(out, 3, "--kill", "1:2:backward", launch=("--min-workers", "3"))
    log = (tmp_path / "job.log").read_text()
    assert code == 1, log
    assert "TooFewWorkersError: worker(s) 1 died and 2 worker(s) are left" in log
    assert not list(out.glob("member-*.json"))  # no survivor finished


def test_survive_refuses_what_it_does_not_cover_before_anything_starts(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(ValueError, match="--survive does not take --servers"):
        LaunchConfig(nproc=2, target=[str(script)], survive=True, servers=1)
    with pytest.raises(ValueError, match="--min-workers must be in"):
        LaunchConfig(nproc=2, target=[str(script)], survive=True, min_workers=3)
    with pytest.raises(ValueError, match="add --survive"):
        LaunchConfig(nproc=2, target=[str(script)], min_workers=2)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_readme_survive_command_trains_the_example(tmp_path: Path) -> None:
    """The README's ``<!-- survive: `` block, as written, in a reader's folder."""
    (block,) = [b for b in readme_blocks.blocks() if (b.note or "").startswith("survive: ")]
    ((words, _),) = readme_blocks.commands(block)
    assert words[:4] == ["gradhub", "run", "-n", "4"] and "--survive" in words, words
    readme_blocks.prepare_folder(tmp_path)
    done = subprocess.run(
        readme_blocks.executable(words),
        cwd=tmp_path,
        env=readme_blocks.launch_env(),
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    metrics = read_metrics(tmp_path / "runs/digits-survive")
    assert sorted(metrics) == [0, 1, 2, 3]
    (summary,) = [r for r in metrics[0] if r["kind"] == "summary"]
    assert (summary["failures"], summary["redone"], summary["world_size"]) == (0, 0, 4)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_demo_survive_row_loses_a_worker_and_reaches_the_accuracy(tmp_path: Path) -> None:
    """``gradhub demo``'s survive row: the last worker killed after half the steps."""
    demo = ["demo", "--strategy", "survive", "--workers", "3", "--epochs", "10"]
    done = subprocess.run(
        [sys.executable, "-m", "gradhub.cli.main", *demo, "--run-dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = [line for line in done.stdout.splitlines() if line.startswith("survive ")]
    assert "1 worker killed, 1 step(s) redone over the 2 survivors" in row, row
    (result,) = [json.loads((tmp_path / "demo/survive/result.json").read_text())]
    assert result["steps"] == 10 * 23 and result["eval_accuracy"] >= 0.95
