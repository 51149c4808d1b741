"""Running the trainer examples as the README's block shows them.

The Hugging Face Trainer's ranks run through the harness
(``ported_jobs.run_script``); Ray's driver starts processes the harness does
not know of (GCS, raylet, agents, workers), and some of them outlive a driver
that is killed. So ``examples/ray_train.py`` runs as a script in a new
session, and every process of that session is killed when it ends, whatever
the outcome.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"


def readme_command(script: str) -> list[str]:
    """The words of the README's command that runs ``examples/<script>.py``."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- trainers: .*?```\n(.*?)```", text, re.S)
    assert block is not None, "README lost its trainers block"
    for line in block.group(1).splitlines():
        words = shlex.split(line, comments=True)
        if f"examples/{script}.py" in words:
            return words
    raise AssertionError(f"the README's trainers block runs no examples/{script}.py")


def run_script_in_session(
    script: str, argv: list[str], env: dict[str, str], log: Path, timeout: float
) -> dict[str, Any]:
    """Run ``examples/<script>.py argv`` to its end; the last JSON object it printed.

    Output goes to ``log``; a failure or a timeout raises ``AssertionError``
    with the log's tail. Every process of the script's session is killed on
    the way out.
    """
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(EXAMPLES / f"{script}.py"), *argv],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{script} ran past {timeout:g}s:\n{_tail(log)}") from None
        assert code == 0, f"{script} exited with {code}:\n{_tail(log)}"
        last = [line for line in log.read_text().splitlines() if line.startswith("{")][-1]
        return dict(json.loads(last))
    finally:
        kill_session(proc.pid)
        proc.wait(10)


def kill_session(sid: int, seconds: float = 10.0) -> None:
    """SIGKILL every living process of session ``sid`` until none is left."""
    deadline = time.monotonic() + seconds
    while pids := _session_pids(sid):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise AssertionError(f"processes {pids} of session {sid} survived SIGKILL")
        time.sleep(0.05)


def _session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` that are not zombies (from /proc)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # pid (comm) state ppid pgrp session ...: comm may hold spaces, ")" ends it
        state, _, _, session = stat.rsplit(")", 1)[1].split()[:4]
        if int(session) == sid and state != "Z":
            pids.append(int(entry))
    return pids


def _tail(log: Path, lines: int = 60) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
