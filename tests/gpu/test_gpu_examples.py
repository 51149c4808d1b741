"""The examples and the demo with ``--device cuda``.

One rank and two: on a machine with one GPU two ranks share it over gloo
(the default backend there, :func:`gradhub.runtime.pick_backend`), on two
GPUs they take NCCL. Every run must learn (its loss falls), as on the CPU
(``tests/jobs/test_examples.py``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gpu_jobs import examples_job
from gradhub.cli.main import main
from harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("world", [1, 2])
def test_examples_learn_on_cuda(world: int, tmp_path: Path) -> None:
    results = run_ranks(examples_job, world, str(EXAMPLES), str(tmp_path), timeout=300)
    out = results[0].value
    both = "cpu:gloo,cuda:nccl"
    assert out["backend"] == (both if torch.cuda.device_count() >= world else "gloo")
    for strategy in ("allreduce", "sharded"):
        port_first, port_last, lm_first, lm_last = out[strategy]
        assert port_last < 0.7 * port_first, (strategy, port_first, port_last)
        assert lm_last < 0.85 * lm_first, (strategy, lm_first, lm_last)
    if world == 1:
        nanogpt = list(out["nanogpt"].values())
        assert nanogpt[-1] < nanogpt[0] and all(math.isfinite(v) for v in nanogpt)
        tutorial = list(out["tutorial"].values())
        assert tutorial[-1] < tutorial[0]


def test_the_demo_trains_on_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["demo", "--device", "cuda", "--workers", "2", "--run-dir", str(tmp_path)]
    code = main([*args, "--strategy", "single", "--strategy", "allreduce", "--strategy", "sharded"])
    out = capsys.readouterr().out
    assert code == 0, out
    for row in ("single", "allreduce", "sharded"):
        assert f"\n{row} " in out, out
