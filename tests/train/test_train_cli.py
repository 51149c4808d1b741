"""``gradhub demo`` end to end, ``gradhub plot``, and the CLI's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradhub.cli.main import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_demo_jobs_reach_95_percent_and_draw_curves(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "demo"
    args = ["--strategy", "allreduce", "--strategy", "ps-sync", "--workers", "2", "--epochs", "4"]
    code = main(["demo", *args, "--run-dir", str(run_dir)])
    out = capsys.readouterr().out
    assert code == 0, out
    for name in ("allreduce", "ps-sync"):
        result = json.loads((run_dir / name / "result.json").read_text())
        assert result["world_size"] == 2
        assert result["eval_accuracy"] >= 0.95
        assert name in out
        records = (run_dir / name / "metrics.rank1.jsonl").read_text().splitlines()
        assert json.loads(records[-1])["kind"] == "summary"
    png = run_dir / "curves.png"
    assert png.read_bytes()[:8] == PNG_SIGNATURE

    png.unlink()
    assert main(["plot", str(run_dir), "-o", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").read_bytes()[:8] == PNG_SIGNATURE


def test_run_refuses_bad_arguments_before_starting_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(0)\n")
    assert main(["run", "-n", "0", str(script)]) == 2
    assert "-n/--nproc must be >= 1" in capsys.readouterr().err
    assert main(["run", "-n", "2", str(tmp_path / "missing.py")]) == 2
    assert "missing.py' not found" in capsys.readouterr().err
    assert main(["run", "-n", "2", "--servers", "-1", str(script)]) == 2
    assert "--servers must be >= 0" in capsys.readouterr().err
    assert main(["run", "-n", "2", "--servers", "1", "--ps-lr", "0", str(script)]) == 2
    assert "lr must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "-n", "2", "--ps-mode", "eventually", str(script)])
    assert main(["run", "-n", "2", "--max-restarts", "-1", str(script)]) == 2
    assert "--max-restarts must be >= 0, got -1" in capsys.readouterr().err


def test_run_help_describes_restarts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-restarts N when a worker fails, restart all workers, up to N times" in text


@pytest.mark.slow
def test_run_reports_a_failing_worker(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    assert main(["run", "-n", "2", str(script)]) == 1


def test_plot_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plot", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.rank*.jsonl" in capsys.readouterr().err
