"""Run folders and secret files of the examples and the CLI: a second run into
a run folder and a missing ``--secret-file`` are one line and a non-zero exit,
never a traceback; and the README's ``--max-restarts`` command, run again into
its folder, is refused on every attempt instead of "resuming" the finished run.
(That one job's ranks share one default run folder of ``examples/train_digits.py``:
``test_readme.py``, which counts the run folders of the README's commands.)"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from backend_trainer_jobs import kill_session

import readme_blocks
from gradhub.cli.main import main


def _launch(words: list[str], cwd: Path, timeout: float = 150) -> tuple[int, str]:
    """Run a README-style command in ``cwd``: (exit code, stdout and stderr)."""
    proc = subprocess.Popen(
        readme_blocks.executable(words),
        cwd=cwd,
        env=readme_blocks.launch_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_session(proc.pid)
        proc.wait(10)
    return proc.returncode, out


def _restarts_command() -> list[str]:
    """The README's --max-restarts command (the block marked ``<!-- restarts: ``)."""
    (block,) = [b for b in readme_blocks.blocks() if (b.note or "").startswith("restarts: ")]
    ((words, _),) = readme_blocks.commands(block)
    return words


def _errors(out: str, script: str) -> list[str]:
    assert "Traceback" not in out, out
    return [line for line in out.splitlines() if line.startswith(f"{script}: error: ")]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_readme_max_restarts_command_run_again_into_its_folder_is_refused(tmp_path: Path) -> None:
    words = _restarts_command()
    assert words[:2] == ["gradhub", "run"] and "--max-restarts" in words, words
    assert words[-3:] == ["examples/train_digits.py", "--run-dir", "runs/digits"], words
    readme_blocks.prepare_folder(tmp_path)
    code, out = _launch(words, tmp_path)
    assert code == 0, out
    metrics = sorted((tmp_path / "runs/digits").glob("metrics.rank*.jsonl"))
    assert [m.name for m in metrics] == ["metrics.rank0.jsonl", "metrics.rank1.jsonl"]
    before = [m.read_bytes() for m in metrics]

    code, out = _launch(words, tmp_path)
    assert code != 0, out
    # Refused on the first attempt and again on each restart (the agent reports
    # each failed attempt once): one line each from rank 0, unless the agent's
    # SIGTERM, sent when another rank exited, reached rank 0 before its print.
    attempts = 1 + int(words[words.index("--max-restarts") + 1])
    errors = _errors(out, "train_digits.py")
    assert 1 <= len(errors) <= attempts, out
    assert out.count("failed (exitcode: ") == attempts, out
    for error in errors:
        assert "run folder runs/digits already holds the metrics of a run" in error, errors
    assert [m.read_bytes() for m in metrics] == before  # nothing trained, nothing written


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_examples_refuse_a_used_run_folder_and_a_missing_secret_file_in_one_line(
    tmp_path: Path,
) -> None:
    readme_blocks.prepare_folder(tmp_path)
    (tmp_path / "runs" / "lm").mkdir(parents=True)
    (tmp_path / "runs" / "lm" / "metrics.rank0.jsonl").write_text("{}\n")  # an earlier run's
    words = shlex.split("python examples/charlm.py --sentences 40 --run-dir runs/lm")
    code, out = _launch(words, tmp_path)
    assert code == 2 and len(_errors(out, "charlm.py")) == 1, out

    words = ["python", "examples/train_digits.py", "--strategy", "ps-async"]
    code, out = _launch([*words, "--secret-file", "missing.txt"], tmp_path)
    (error,) = _errors(out, "train_digits.py")
    assert code == 2 and "cannot read the secret file missing.txt" in error, out


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "missing.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    for argv in (
        ["serve", "--secret-file", missing],
        ["serve", "--secret-file", str(empty)],
        ["run", "-n", "2", "--servers", "1", "--ps-secret-file", missing, "train.py"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"gradhub {argv[0]}: error: ") and err.count("\n") == 1, err
        assert "secret file" in err, err
    # gradhub demo refuses a run folder that holds a strategy's metrics before training.
    (tmp_path / "demo" / "single").mkdir(parents=True)
    (tmp_path / "demo" / "single" / "metrics.rank0.jsonl").write_text("{}\n")
    assert main(["demo", "--strategy", "single", "--run-dir", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradhub demo: error: run folder ") and err.count("\n") == 1, err
