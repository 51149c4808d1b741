"""DDP, FSDP2, Lightning and Accelerate on the gradhub backend; a rank killed mid-step."""

from __future__ import annotations

import pytest
from backend_training_jobs import accelerate_job, ddp_and_fsdp, killed_during_ddp, lightning_job

from harness import run_ranks


@pytest.mark.slow
def test_ddp_bits_and_fsdp2() -> None:
    results = run_ranks(ddp_and_fsdp, 2, timeout=180)
    for r in results:
        # Two ranks: gradhub forms x0 + x1 as gloo does (fp32 addition commutes),
        # so DDP ends with gloo's bits exactly.
        assert r.value["ddp_equal"], r.value
        # FSDP2 averages the gradient shards (AVG); against one process on the
        # combined batch only the summation order of the mean differs: 1e-5.
        assert r.value["fsdp_error"] < 1e-5, r.value
        assert r.value["mesh_backend"] == "gradhub"


@pytest.mark.slow
def test_killed_rank_is_named() -> None:
    timeout = 20.0
    results = run_ranks(killed_during_ddp, 2, timeout, timeout=120, check=False)
    survivor = results[0]
    assert survivor.error is None, survivor.error
    error = survivor.value["error"]
    # DDP's reducer re-raises the work's error as a RuntimeError carrying
    # gradhub's typed error (class and message) in its text.
    assert error is not None and "WorkerFailedError" in error, error
    assert "rank 1 (pid" in error and "died" in error, error
    assert survivor.value["seconds"] < timeout, survivor.value
    assert results[1].exitcode == -9


@pytest.mark.slow
def test_lightning_ddp_strategy() -> None:
    env = {"TORCHELASTIC_RUN_ID": "gradhub-test", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"}
    results = run_ranks(lightning_job, 2, timeout=180, env=env)
    for r in results:
        assert r.value["backend"] == "gradhub", r.value
        assert r.value["same"] and r.value["changed"] and r.value["steps"] == 8, r.value


@pytest.mark.slow
def test_accelerate_on_initialised_group() -> None:
    results = run_ranks(accelerate_job, 2, timeout=180)
    for r in results:
        assert r.value == {"same": True, "ddp": True, "backend": "gradhub", "processes": 2}
