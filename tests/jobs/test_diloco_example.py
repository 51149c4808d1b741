"""examples/diloco_lm.py on 2 ranks: allreduce, DiLoCo and streaming DiLoCo (fp4)
train, their metrics hold the bytes each worker sent, and ``gradhub plot`` draws
the validation loss against them."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import gradhub
from gradhub.cli.main import main as cli
from harness import run_ranks

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = ["--layers", "1", "--width", "32", "--batch", "4", "--seq", "32", "--device", "cpu"]
STEPS, H = 60, 20
RUNS = {
    "allreduce": ["--strategy", "allreduce"],
    "diloco": ["--strategy", "diloco", "--inner-steps", str(H)],
    "streaming": [
        "--strategy", "diloco", "--inner-steps", str(H), "--fragments", "2", "--overlap", "2",
        "--compress", "fp4",
    ],
}  # fmt: skip


def _job(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    sys.path.insert(0, str(EXAMPLES))
    example = importlib.import_module("diloco_lm")
    common = [*TINY, "--steps", str(STEPS), "--eval-every", "20", "--corpus-bytes", "400000"]
    with gradhub.init(timeout=60):  # one process group; the example's init() adopts it
        return {
            name: example.main([*argv, *common, "--run-dir", f"{run_dir}/{name}"])
            for name, argv in RUNS.items()
        }


def test_diloco_example_trains_and_counts_its_bytes(tmp_path: Path) -> None:
    results = run_ranks(_job, 2, str(tmp_path), timeout=120)[0].value
    sys.path.insert(0, str(EXAMPLES))
    example = importlib.import_module("diloco_lm")
    records = {}
    for name, result in results.items():
        assert result["last"] < 0.9 * result["first"], (name, result)  # it trains
        lines = (tmp_path / name / "metrics.rank0.jsonl").read_text().splitlines()
        evals = [r for r in map(json.loads, lines) if r["kind"] == "eval"]
        assert [r["step"] for r in evals] == [1, 20, 40, 60]
        assert evals[-1]["samples"] == STEPS * 4 * 2
        assert evals[-1]["bytes_sent"] == result["bytes_sent"] > 0
        records[name] = evals
    # The formula (README, "Slow links: DiLoCo"), 2 ranks: allreduce sends the
    # ring's 2 (P - 1) / P * 4 n every step, diloco the same once per H steps;
    # streaming fp4 (P - 1) (0.625 n_f + 16) per fragment, each fragment once per H.
    numel = 32 * 256 + 32 * 32 + 12 * 32 * 32 + 2 * 32 + 32  # embeddings, 1 block, norms
    sent = {name: evals[-1]["bytes_sent"] for name, evals in records.items()}
    assert sent["allreduce"] == pytest.approx(STEPS * 4 * numel)
    assert sent["allreduce"] / sent["diloco"] == pytest.approx(H)
    assert sent["streaming"] == pytest.approx(STEPS // H * (0.625 * numel + 2 * 16))
    assert sent["diloco"] / sent["streaming"] > 6  # fp4: 6.4 times fewer bytes per value
    assert example.sync_bytes(numel, 2, "none") == 4 * numel
    # gradhub plot: the validation loss against the bytes each worker sent.
    assert cli(["plot", str(tmp_path), "-o", str(tmp_path / "curves.png")]) == 0
    assert (tmp_path / "curves.png").stat().st_size > 10_000
