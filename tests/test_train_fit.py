"""``fit`` on every kind of data, and its settings and errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import gradhub
from fit_jobs import data, fit_kinds, mlp
from harness import run_ranks


def test_fit_on_every_kind_of_data() -> None:
    results = run_ranks(fit_kinds, 2, timeout=180)
    out = results[0].value
    for name, (losses, accuracy, _) in out.items():
        assert losses[-1] < losses[0], (name, losses)
        applies = name not in ("regression",)
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
        for a, b in zip(out[name][2], results[1].value[name][2], strict=True):
            assert np.array_equal(a, b), name


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
        with pytest.raises(
            ValueError,
            match=r"(?s)'fp16' is not supported, on CPU or on CUDA.*use precision='bf16'",
        ):
            trainer.fit((x, y), precision="fp16")
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
