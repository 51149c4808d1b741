"""The ``allreduce`` strategy and ``fit``: exactness, resume, failures (real processes)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import gradhub
from harness import run_ranks
from train_helpers import fixed_data, reference_step, sgd, tiny_model, uneven_steps


@pytest.mark.slow
def test_allreduce_uneven_batches_equal_single_process_steps() -> None:
    # Tiny buckets, so several buckets and the overlapped launch path are used.
    results = run_ranks(uneven_steps, 2, "allreduce", {"bucket_mb": 0.0005}, timeout=90)
    expected = reference_step(sgd, steps=3)
    for r in results:
        for got, want in zip(r.value, expected, strict=True):
            # (5 * mean5 + 3 * mean3) / 8 vs mean8 reorders float32 sums; over 3
            # momentum steps the difference stays a few ulps of values ~1.
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=1e-6)


def _fit_job(
    rank: int, world_size: int, ckpt: str, die_at: int, resume: bool
) -> tuple[str, Any, Any]:
    runtime = gradhub.init(timeout=20)
    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    trainer = gradhub.DataParallelTrainer(model, opt, strategy="allreduce", runtime=runtime)

    def on_step(step: int, record: dict[str, Any]) -> None:
        if rank == 1 and step == die_at:
            os._exit(17)  # a crash: no clean-up, no goodbye

    x, y = fixed_data(n=30)  # 30 samples, batch 8: 4 steps per epoch, the last one of 6
    try:
        result = trainer.fit(
            (x, y),
            epochs=3,
            batch_size=8,
            checkpoint_dir=ckpt,
            checkpoint_every=3,
            resume=resume,
            progress=False,
            on_step=on_step,
        )
    except gradhub.WorkerFailedError as exc:
        return "failed", str(exc), None
    finally:
        trainer.close()
        runtime.close()
    return "ok", (result.start_step, result.steps), [p.detach().numpy() for p in model.parameters()]


def _single_process_fit() -> list[torch.Tensor]:
    runtime = gradhub.init(timeout=20)
    try:
        model = tiny_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        trainer = gradhub.DataParallelTrainer(model, opt, runtime=runtime)
        trainer.fit(fixed_data(n=30), epochs=3, batch_size=8, progress=False)
        trainer.close()
    finally:
        runtime.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_dead_rank_is_named_and_a_resumed_job_continues_from_the_checkpoint(
    tmp_path: Path,
) -> None:
    ckpt = str(tmp_path / "ckpt")
    first = run_ranks(_fit_job, 2, ckpt, 8, False, timeout=90, check=False)
    status, message, _ = first[0].value
    assert status == "failed"
    assert "rank(s) 1 died" in message
    assert first[1].exitcode == 17
    # Checkpoints every 3 steps: step 6 is the last one both ranks wrote.
    assert sorted(p.name for p in Path(ckpt).iterdir() if p.name.startswith("step-00000006"))

    second = run_ranks(_fit_job, 2, ckpt, -1, True, timeout=90)
    expected = _single_process_fit()
    for r in second:
        status, (start, steps), params = r.value
        assert status == "ok" and start == 6 and steps == 12
        for got, want in zip(params, expected, strict=True):
            # Interrupted 2-rank training == uninterrupted 1-process training;
            # the weighted sum reorders float32 additions: a few ulps per step.
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=1e-5)


def test_unknown_strategy_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match=r"(?s)unknown strategy 'ring'.*allreduce"):
        gradhub.DataParallelTrainer(tiny_model(), None, strategy="ring")


def test_fit_errors_before_work() -> None:
    model = tiny_model()
    trainer = gradhub.DataParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="unknown fit setting"):
        trainer.fit(fixed_data(), epoch=1)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        trainer.fit(fixed_data(), batch_size=0)
    with pytest.raises(ValueError, match="same, non-zero number of samples"):
        trainer.fit((torch.zeros(3, 6), torch.zeros(2)))
    assert trainer.runtime is None  # nothing was set up


def _small_batch(rank: int, world_size: int) -> str:
    model = tiny_model()
    trainer = gradhub.DataParallelTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        trainer.fit(fixed_data(), batch_size=1, progress=False)
    except ValueError as exc:
        return str(exc)
    finally:
        trainer.close()
    return "no error"


@pytest.mark.slow
def test_batch_smaller_than_workers_is_an_error() -> None:
    for r in run_ranks(_small_batch, 2, timeout=60):
        assert "batch size 1 is smaller than the number of workers (2)" in r.value


@pytest.mark.slow
def test_sharded_uneven_batches_equal_single_process_steps() -> None:
    results = run_ranks(uneven_steps, 2, "sharded", {"compress": "none"}, timeout=90)
    expected = reference_step(sgd, steps=3)
    for r in results:
        for got, want in zip(r.value, expected, strict=True):
            # Same arithmetic as allreduce (weighted fp32 sums, one division),
            # in ring order: a few ulps of values ~1.
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=1e-6)
