"""benchmarks/gpu.py starts anywhere: it parses its options, and without CUDA it
says so and exits with status 2 (its measurements run in tests/gpu's world)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_the_gpu_benchmark_takes_its_options() -> None:
    done = _run("--help")
    assert done.returncode == 0 and "--models" in done.stdout and "GPT-2 small" in done.stdout
    assert _run("--rounds", "3").returncode == 2  # fewer than 5 rounds: refused


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_the_gpu_benchmark_says_it_needs_cuda() -> None:
    done = _run("--out", "/nonexistent")
    assert done.returncode == 2 and "needs CUDA" in done.stderr and done.stdout == ""
