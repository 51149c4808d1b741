"""Own loops, the README's command and the demo row of a surviving job
(``gradhub run --survive``): the user's loop with ``GlobalBatchSampler`` (with
and without loader workers) checked as ``test_survive.py`` checks ``fit``
(``survive_checks.py``: the survivors' processes, steps and parameters)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import readme_blocks
from gradhub.train.metrics import read_metrics
from survive_checks import STEPS, check_survivors, members, run_job


@pytest.mark.slow
def test_own_loop_survives_two_kills_one_of_rank_0(
    tmp_path: Path, adamw: dict[str, torch.Tensor]
) -> None:
    """AdamW, the user's loop with GlobalBatchSampler (no loader workers): rank 0
    dies after step 3 committed, member 2 (then rank 1) in step 9's backward."""
    out = tmp_path / "job"
    kills = ["--kill", "0:3:between", "--kill", "2:9:backward"]
    code = run_job(out, 4, "--loop", "--optimizer", "adamw", *kills)
    assert code == 0, (tmp_path / "job.log").read_text()
    check_survivors(out, [1, 3], adamw)
    for m in members(out).values():
        assert m["iterations"] == STEPS + 2  # steps 4 and 9 trained twice, nothing lost


@pytest.mark.slow
def test_own_loop_with_a_prefetching_loader_survives(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    """DataLoader(num_workers=2) asks for 4 shares ahead: those fetched before the
    regroup are trained locally and never applied; the same global batch follows."""
    out = tmp_path / "job"
    code = run_job(out, 4, "--loop", "--loader-workers", "2", "--kill", "3:7:backward")
    assert code == 0, (tmp_path / "job.log").read_text()
    check_survivors(out, [0, 1, 2], sgd)


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
