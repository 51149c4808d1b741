"""``fit`` on every kind of data, and its settings and errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

import gradhub
from fit_jobs import clipped_reference, data, fit_kinds, mlp
from gradhub.errors import RunFolderExistsError
from gradhub.train.checkpoint import CheckpointDir
from gradhub.train.metrics import read_metrics
from harness import run_ranks


@pytest.fixture(scope="module")
def fit_kinds_results() -> list[Any]:
    return run_ranks(fit_kinds, 2, timeout=180)


def test_fit_on_every_kind_of_data(fit_kinds_results: list[Any]) -> None:
    results = [r.value["runs"] for r in fit_kinds_results]
    out = results[0]
    for name, (losses, accuracy, _) in out.items():
        assert losses[-1] < losses[0], (name, losses)
        # No accuracy for a regression, without "accuracy" in metrics, or for a
        # dict output without "logits" (nothing says which entry holds them).
        applies = name not in ("regression", "loss only", "custom loss")
        assert (accuracy is not None) == applies, (name, accuracy)
    # The same global batches through tensors, a TensorDataset and a map-style
    # Dataset of tuples: the same steps, the same bits.
    for name in ("tensordataset", "mapstyle", "dicts"):
        for a, b in zip(out[name][2], out["tensors"][2], strict=True):
            assert np.array_equal(a, b), name
    # 2 micro-batches of 4 with a constant schedule = 1 batch of 8: float rounding only.
    for a, b in zip(out["accumulate"][2], out["tensors"][2], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    # A scheduler made before fit drives the sharded slice optimizer as it drives
    # the local one (slices summed separately: float32 rounding only).
    for a, b in zip(out["scheduled sharded"][2], out["scheduled allreduce"][2], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    # Both ranks hold the same model.
    for name in out:
        for a, b in zip(out[name][2], results[1][name][2], strict=True):
            assert np.array_equal(a, b), name


def test_fit_grad_clip_clips_by_the_global_norm(fit_kinds_results: list[Any]) -> None:
    want, norms = clipped_reference(0.05, epochs=2)
    per_rank = clipped_reference(0.05, epochs=2, per_rank=True)[0]
    assert min(norms) > 0.05 * 5  # the clip binds at every step, by far
    out = fit_kinds_results[0].value["runs"]
    for strategy in ("allreduce", "sharded"):
        got = out[f"clip {strategy}"][2]
        # The global gradient is the two halves' mean (sharded: its norm summed
        # from the slices): float32 rounding of another summation order only
        # (3e-8 after these 6 steps when measured; the per-rank clip is 5e-3 off).
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
        # Clipping each rank's half by its own norm would be far outside that.
        off = max(float(np.abs(a - b).max()) for a, b in zip(got, per_rank, strict=True))
        assert off > 1e-4


def test_each_rank_trains_on_its_own_shard_and_the_ranks_cover_the_data(
    fit_kinds_results: list[Any],
) -> None:
    extra = [r.value["extra"] for r in fit_kinds_results]
    for name, n in (
        ("ids iterable", 25),
        ("ids loader over iterable", 25),
        ("ids loader", 24),
        ("ids loader 25", 25),
        ("ids ddp loader", 24),
    ):
        for epoch in range(2):
            mine, other = extra[0][name][epoch], extra[1][name][epoch]
            assert mine and other, (name, epoch)
            if name == "ids loader 25":
                # As DistributedSampler: 25 does not split in 2, so one sample is
                # repeated to give both ranks 13; every sample is seen.
                assert len(mine) == len(other) == 13
                assert sorted(set(mine + other)) == list(range(n))
                continue
            assert not set(mine) & set(other), (name, epoch)  # disjoint
            assert sorted(mine + other) == list(range(n)), (name, epoch)  # each once
    # The loaders shuffled: a new order every epoch (DistributedSampler.set_epoch).
    for name in ("ids loader", "ids ddp loader"):
        assert extra[0][name][0] != extra[0][name][1], name


def test_fit_metrics_callbacks_custom_loss_and_bf16(fit_kinds_results: list[Any]) -> None:
    out, extra = fit_kinds_results[0].value["runs"], fit_kinds_results[0].value["extra"]
    # on_epoch: once per epoch with the epoch's record; on_eval: once per evaluation.
    seen = extra["metrics"]
    history = seen["history"]
    assert [e for e, _ in seen["on_epoch"]] == [0, 1, 2]
    assert [r for _, r in seen["on_epoch"]] == history
    assert [e for e, _ in seen["on_eval"]] == [0, 1, 2]
    assert extra["on_eval without eval_data"] == []
    for (_, record), want in zip(seen["on_eval"], history, strict=True):
        assert record == want
        # The callable is reported for training and evaluation, averaged over the
        # samples of both ranks as accuracy is: 1 - accuracy up to float rounding.
        for prefix in ("train_", "eval_"):
            assert record[f"{prefix}error_rate"] == pytest.approx(
                1 - record[f"{prefix}accuracy"], abs=1e-9
            )
            assert record[f"{prefix}loss"] is not None
    # loss_fn reading the output dict's "scores": the same cross-entropy as the
    # default on plain logits, on the same batches: the same bits.
    for a, b in zip(out["custom loss"][2], out["tensors"][2], strict=True):
        assert np.array_equal(a, b)
    # bf16 autocast on CPU: parameters and gradients stay fp32, the forward ran in
    # bf16 (the result differs from fp32's, within bf16's 8 significant bits).
    assert extra["bf16 dtypes"] == ["torch.float32"]
    bf16, fp32 = out["bf16"][2], out["tensors"][2]
    assert any(not np.array_equal(a, b) for a, b in zip(bf16, fp32, strict=True))
    for a, b in zip(bf16, fp32, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=5e-2)


def test_fit_settings_errors_and_run_folders(tmp_path: Path) -> None:
    x, y = data()
    model = mlp()
    with gradhub.init(timeout=10) as runtime:
        trainer = gradhub.DataParallelTrainer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), runtime=runtime
        )
        with pytest.raises(TypeError, match=r"unknown fit setting\(s\): epoch\n.*valid.*epochs"):
            trainer.fit((x, y), epoch=1)
        with pytest.raises(TypeError, match="a Dataset, an IterableDataset or a DataLoader"):
            trainer.fit([1, 2, 3])
        with pytest.raises(ValueError, match="precision is 'fp32', 'bf16' or 'fp16', got 'fp8'"):
            trainer.fit((x, y), precision="fp8")
        pairs = TensorDataset(x, y)
        weighted = WeightedRandomSampler([1.0] * len(x), len(x))
        with pytest.raises(TypeError, match="a WeightedRandomSampler of its own"):
            trainer.fit(DataLoader(pairs, batch_size=4, sampler=weighted))
        batches = BatchSampler(SequentialSampler(pairs), 4, drop_last=False)
        with pytest.raises(TypeError, match="a BatchSampler of its own"):
            trainer.fit(DataLoader(pairs, batch_sampler=batches))
        with pytest.raises(ValueError, match=r"unknown metric 'f1'\n.*'accuracy', 'loss'"):
            trainer.fit((x, y), metrics=["accuracy", "f1"])
        with pytest.raises(ValueError, match="no name to report it under"):
            trainer.fit((x, y), metrics=[lambda output, batch: 0.0])

        def accuracy(output: object, batch: object) -> float:
            return 0.0

        with pytest.raises(ValueError, match="accuracy given more than once"):
            trainer.fit((x, y), metrics=["accuracy", accuracy])
        run, ckpt = tmp_path / "run", tmp_path / "ckpt"
        first = trainer.fit((x, y), epochs=2, run_dir=run, checkpoint_dir=ckpt, progress=False)
        with pytest.raises(FileExistsError, match="already holds the metrics"):
            trainer.fit((x, y), epochs=2, run_dir=run, progress=False)
        again = trainer.fit(
            (x, y), epochs=2, run_dir=run, checkpoint_dir=ckpt, resume=True, progress=False
        )
        trainer.close()
    # A finished job resumed: nothing left to do, its last metrics come back.
    assert again.steps == first.steps and again.start_step == first.steps
    assert again.train_loss == pytest.approx(first.train_loss)
    assert again.train_accuracy == pytest.approx(first.train_accuracy)


def test_fit_checkpoints_and_resumes_on_its_own_when_torchrun_may_restart_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """torchrun's agent says in the workers' environment how many restarts it
    allows and which attempt this is (``gradhub run --max-restarts 1``), and
    keeps its store, which the workers join, for every attempt of the job."""
    x, y = data()  # 24 samples in batches of 8: 3 steps per epoch
    run = tmp_path / "run"
    agent = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    launcher = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**launcher, "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)

    def attempt(restart: int, epochs: int, **settings: object) -> gradhub.FitResult:
        monkeypatch.setenv("MASTER_PORT", str(agent.port))
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
        model = mlp()
        with gradhub.init(timeout=10) as runtime:
            assert (runtime.restart, runtime.max_restarts) == (restart, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with gradhub.DataParallelTrainer(model, opt, runtime=runtime) as trainer:
                kw = {"batch_size": 8, "run_dir": run, "progress": False, **settings}
                return trainer.fit((x, y), epochs=epochs, **kw)

    first = attempt(0, 2)  # checkpoints on by default, under the run folder
    assert first.restarts == 0 and first.steps == 6
    folder = run / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == [
        "step-00000003.rank0.pt",
        "step-00000006.rank0.pt",
    ]
    again = attempt(1, 3)  # a restarted worker: same run folder, no resume=True needed
    assert (again.start_step, again.steps, again.restarts) == (6, 9, 1)
    records = read_metrics(run)[0]
    assert [(r["restart"], r["step"]) for r in records if r["kind"] == "restart"] == [(1, 6)]
    assert records[-1]["kind"] == "summary" and records[-1]["restarts"] == 1
    # Another job (another agent) into the same folder: no earlier attempt of it
    # started the run, so its restarted workers refuse the folder as its first did.
    agent = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with pytest.raises(RunFolderExistsError, match="already holds the metrics of a run"):
        attempt(1, 4)

    # Automatic checkpoints turned off: a restart starts over, as under plain torchrun.
    with caplog.at_level("WARNING", logger="gradhub.train.fit"):
        over = attempt(1, 1, resume_on_restart=False, run_dir=tmp_path / "other")
    assert over.start_step == 0 and not (tmp_path / "other" / "checkpoints").exists()
    assert "resume_on_restart=False: a restarted worker starts over from step 0" in caplog.text


def test_a_resumed_rank_drops_its_checkpoints_after_the_step_it_resumes_from(
    tmp_path: Path,
) -> None:
    # Step 9 was written by this rank only before the job died; the job resumes
    # from 6 and writes 9 again, which must not sit beside the old one.
    ckpt = CheckpointDir(path=tmp_path, rank=1, keep=3)
    for step in (3, 6, 9):
        ckpt.save(step, {"weights": torch.full((2,), float(step))})
    ckpt.discard_after(6)
    assert ckpt.steps() == [3, 6]
    assert ckpt.load(6)["weights"].tolist() == [6.0, 6.0]
