"""``sharded`` jobs whose survivors never stop: ``gradhub run -n 4 --survive``.

The same job and checks as ``test_survive.py`` (exit 0, the survivors'
processes the ones started, the fault-free number of committed steps,
survivors bit-identical, parameters equal to a single process's on the same
global batches within 1e-5: sums over 2 or 3 ranks instead of 1, another
order of float32 additions), under ``strategy="sharded"``, whose optimizer
state lives in slices: a dead rank's slice comes from its mirror on another
rank, and the slices are re-partitioned over the survivors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradhub.train.metrics import read_metrics
from survive_checks import STEPS, check_survivors, members, run_job

SHARDED = ("--strategy", "sharded")


@pytest.mark.slow
def test_fit_survives_a_kill_in_the_backward_and_one_in_the_optimizer_exchange(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    """Momentum SGD. Member 2 dies in the middle of step 5's backward (its
    bucket reduce-scatters under way); member 1 in step 12's optimizer step,
    right after it stepped its own slice and before the updated slices are
    all-gathered. Their slices' momentum comes from their mirrors."""
    out = tmp_path / "job"
    code = run_job(out, 4, *SHARDED, "--kill", "2:5:backward", "--kill", "1:12:exchange")
    assert code == 0, (tmp_path / "job.log").read_text()
    check_survivors(out, [0, 3], sgd)
    for m in members(out).values():
        assert m["result"]["steps"] == STEPS and m["result"]["failures"] == 2
    metrics = read_metrics(out / "run")
    generations = [(r["members"], r["dead"]) for r in metrics[0] if r["kind"] == "membership"]
    assert generations == [([0, 1, 3], [2]), ([0, 3], [1])]


@pytest.mark.slow
def test_own_loop_with_adamw_survives_two_kills_one_of_rank_0(
    tmp_path: Path, adamw: dict[str, torch.Tensor]
) -> None:
    """AdamW (its two moments and step count per slice), an own loop with
    ``GlobalBatchSampler``: rank 0 dies in step 4's backward, member 3 after
    step 9 committed."""
    out = tmp_path / "job"
    kills = ["--kill", "0:4:backward", "--kill", "3:9:between"]
    code = run_job(out, 4, *SHARDED, "--loop", "--optimizer", "adamw", *kills)
    assert code == 0, (tmp_path / "job.log").read_text()
    check_survivors(out, [1, 2], adamw)


@pytest.mark.slow
def test_a_replacement_takes_its_slice_from_the_survivors(
    tmp_path: Path, sgd: dict[str, torch.Tensor]
) -> None:
    """``--max-restarts 1``: member 2 dies in step 5; member 4 joins at a step
    boundary and takes the parameters and its slice of the optimizer state
    (and a mirror) from the survivors, not from a file: all 4 end identical."""
    out = tmp_path / "job"
    args = [*SHARDED, "--kill", "2:5:backward", "--hold", "8"]
    code = run_job(out, 4, *args, launch=("--max-restarts", "1"))
    assert code == 0, (tmp_path / "job.log").read_text()
    check_survivors(out, [0, 1, 3, 4], sgd, world_size=4)
    joined = members(out)[4]["result"]
    assert joined["start_step"] >= 8 and joined["steps"] == STEPS
