"""The trainers users already run, on the gradhub backend, through the examples
the README shows: the Hugging Face Trainer (``examples/hf_trainer.py``, 2
ranks) and Ray Train's TorchTrainer (``examples/ray_train.py``, a local Ray
cluster of 2 workers)."""

from __future__ import annotations

import ast
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest
from backend_trainer_jobs import EXAMPLES, readme_command, run_script_in_session

from harness import run_ranks
from ported_jobs import run_script


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_hf_trainer_example(tmp_path: Path) -> None:
    # torchrun's environment: one OpenMP thread per rank (run_script sets torch's),
    # and no Hugging Face Hub: the model is built from its config, nothing is downloaded.
    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = readme_command("hf_trainer")
    assert command[:4] == ["torchrun", "--nproc-per-node", "2", "examples/hf_trainer.py"], command
    argv = [*command[4:], "--output-dir", str(tmp_path / "out")]
    results = run_ranks(run_script, 2, "hf_trainer", argv, str(tmp_path), env=env, timeout=150)
    for r in results:
        assert r.value["backend"] == "gradhub", r.value
        assert r.value["ddp"] == "DistributedDataParallel", r.value
        assert not r.value["group_after_main"], r.value  # the script ended its group
    # The same bits on both ranks: digests each rank took of its own parameters.
    assert len({r.value["digest"] for r in results}) == 1, [r.value for r in results]
    assert results[0].value["replicas"] == results[1].value["replicas"]
    # The held-out loss, gathered over both ranks. Its floor is ln(3)/15 = 0.073
    # (the first token and the step are random, the rest follows from two tokens);
    # a model that reads one token only stays near ln(3) = 1.1, guessing at
    # ln(16) = 2.77. Below 0.3 the model has learnt the counting rule (300 steps
    # reach about 0.13).
    assert results[0].value["loss"] == results[1].value["loss"]
    assert results[0].value["loss"] < 0.3, results[0].value


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ray_train_example(tmp_path: Path) -> None:
    # Ray's session folder holds Unix sockets, whose paths must stay under 108
    # bytes: a short folder of this test's own rather than tmp_path. A token of
    # its own keeps Ray's token authentication on without writing ~/.ray. Ray
    # Train gives its workers 60 s to start (import torch, Ray Train): a loaded
    # 2-core machine has taken 45 s, so 150 here.
    ray_tmp = tempfile.mkdtemp(prefix="gradhub-ray-", dir="/tmp")
    env = {
        **os.environ,
        "RAY_TMPDIR": ray_tmp,
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "150",
    }
    command = readme_command("ray_train")
    assert command[:2] == ["python", "examples/ray_train.py"], command
    argv = [*command[2:], "--storage-path", str(tmp_path / "ray_results")]
    try:
        out = run_script_in_session("ray_train", argv, env, tmp_path / "ray.log", timeout=200)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    # The workers import torch, never gradhub: "gradhub" is known there only
    # through the torch.backends entry point.
    assert out["backend"] == "gradhub", out
    # Both workers' parameters and rank 0's checkpoint: one digest.
    assert len(out["replicas"]) == 2 and set(out["replicas"]) == {out["checkpoint"]}, out
    # y = x @ w + noise of standard deviation 0.1: a fitted linear model's mean
    # squared error is the noise's variance, 0.01 (the least-squares fit of
    # these 512 samples: 0.0096); 4 epochs of SGD reach 0.0101 from 11.4.
    assert 0.008 < out["loss"] < 0.02, out


def test_examples_do_not_import_gradhub() -> None:
    # What the README promises: the entry point is all these scripts need.
    for script in ("hf_trainer.py", "ray_train.py"):
        tree = ast.parse((EXAMPLES / script).read_text())
        modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in modules if m.split(".")[0] == "gradhub"}, script
