"""The README's code blocks, and running them as a reader would.

A block is a fenced code block of ``README.md`` (also one indented in a list).
The HTML comment on the line right above its fence, if any, says how it runs:

- none: a ``python`` block runs as a script of its own (``python block.py``) in
  a fresh temporary folder; a block without a language is a list of shell
  commands, each run under the launcher it names (``gradhub``, ``torchrun``,
  ``python``) in a fresh temporary folder of its own. Any other block needs a
  comment.
- ``<!-- run: torchrun --nproc-per-node 2 -->``: the ``python`` block runs as a
  script on that many ranks. For a ``diff`` block, its new side (the context
  and the ``+`` lines) runs, after the Python of the comment's further lines
  (what the diff leaves to the script, e.g. its model and data).
- ``<!-- KEY: tests/PATH.py runs ... -->``: another test runs the block, reading
  it from the README by that comment (a file of that test's folder holds
  ``<!-- KEY:``).
- ``<!-- not run: REASON -->``: not run anywhere, for the reason given (other
  machines, a GPU, an install, minutes of work; or not a program at all).

Python blocks run as ``__main__`` in processes of the test harness
(``run_ranks``: fresh processes forked from one that imported torch once, with
torchrun's environment for a ``run:`` block and no launcher's for the others),
each block in a fresh folder of its own. Shell commands run as real processes.
How shell commands run: ``gradhub serve`` (in the foreground or with ``&``)
is started and, once it listens, left running until the block's other
commands have finished; then it is stopped with SIGTERM and must exit 0.
Every other command must exit 0 within its timeout. The ports of ``tcp://``
addresses are swapped for free ones (the same swap for every command of one
block), and plain ``torchrun`` gets a free port through ``PET_MASTER_PORT``
(its ``--master-port``); otherwise the words are the README's. The folder holds
``examples`` (a link to the repository's) and ``secret.txt``, the shared secret
the README's commands name.
"""

from __future__ import annotations

import contextlib
import os
import re
import runpy
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from backend_trainer_jobs import kill_session

from harness import free_port, run_ranks
from ported_jobs import _wait_for_every_rank as wait_for_every_rank

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
BIN = Path(sys.executable).parent
LAUNCHERS = ("gradhub", "torchrun", "python")

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
_ELSEWHERE = re.compile(r"^(?P<key>[\w-]+): (?P<test>tests/\S+\.py) runs\b")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it starts, its language, its text, its comment."""

    line: int
    """Line number (from 1) of the opening fence."""
    lang: str
    text: str
    """The lines between the fences, the fence's indentation taken off."""
    note: str | None
    """The text of the HTML comment right above the fence, or ``None``."""

    @property
    def name(self) -> str:
        first = next((s for s in self.text.splitlines() if s.strip()), "")
        return f"README.md:{self.line} ({self.lang or 'commands'}: {first.strip()[:40]})"

    @property
    def kind(self) -> str:
        """``python``, ``commands``, ``launched`` (``run:``), ``elsewhere``,
        ``not run``, or ``unmarked`` (a block the test cannot run as it is)."""
        note = self.note or ""
        if note.startswith("not run:"):
            return "not run"
        if _ELSEWHERE.match(note):
            return "elsewhere"
        if note.startswith("run:"):
            return "launched"
        if not note and self.lang == "python":
            return "python"
        if not note and self.lang == "":
            return "commands"
        return "unmarked"


def blocks(text: str | None = None) -> list[Block]:
    """Every fenced block of the README (or of ``text``), in order."""
    lines = (README.read_text() if text is None else text).splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, start = len(m.group("indent")), i
        i += 1
        body = []
        while lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        found.append(Block(start + 1, m.group("lang"), "\n".join(body) + "\n", _note(lines, start)))
        i += 1
    return found


def _note(lines: list[str], fence: int) -> str | None:
    above = lines[fence - 1].strip() if fence else ""
    if not above.endswith("-->"):
        return None
    begin = fence - 1
    while "<!--" not in lines[begin]:
        begin -= 1
    text = "\n".join(s.strip() for s in lines[begin:fence])
    return text.split("<!--", 1)[1].rsplit("-->", 1)[0].strip()


def elsewhere(block: Block) -> tuple[str, Path]:
    """(key, test file) of a block that another test runs."""
    m = _ELSEWHERE.match(block.note or "")
    assert m is not None, block.name
    return m.group("key"), REPO / m.group("test")


def script(block: Block) -> tuple[int, str]:
    """(ranks, Python source) of a ``python`` (0 ranks: no launcher) or ``run:`` block."""
    if block.kind == "python":
        return 0, block.text
    first, _, prelude = (block.note or "").partition("\n")
    launcher = shlex.split(first.removeprefix("run:"))
    assert launcher[:2] == ["torchrun", "--nproc-per-node"], f"{block.name}: {launcher}"
    ranks = int(launcher[2])
    if block.lang == "diff":  # the new side: context and added lines
        kept = [s[1:] for s in block.text.splitlines() if s[:1] in (" ", "+")]
        return ranks, prelude + "\n" + "\n".join(kept) + "\n"
    assert block.lang == "python" and not prelude, f"{block.name}: run: takes python or diff"
    return ranks, block.text


def run_block(rank: int, world: int, folder: str, launched: bool) -> None:
    """One rank (a harness process) of a python block: ``folder/block.py`` as ``__main__``."""
    if launched:
        torch.set_num_threads(1)  # what torchrun's OMP_NUM_THREADS=1 gives each rank
    else:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            del os.environ[key]
    with (
        contextlib.chdir(folder),
        open(f"rank{rank}.log", "w") as log,
        contextlib.redirect_stdout(log),
    ):
        sys.argv = ["block.py"]
        runpy.run_path("block.py", run_name="__main__")
    if launched:
        wait_for_every_rank(Path(folder), rank, world)


def run_python(block: Block, folder: Path, timeout: float) -> None:
    """Run a python or ``run:`` block in ``folder`` (see the module doc)."""
    ranks, source = script(block)
    (folder / "block.py").write_text(source)
    run_ranks(run_block, max(ranks, 1), str(folder), ranks > 0, timeout=timeout)


def commands(block: Block) -> list[tuple[list[str], bool]]:
    """The commands of a shell block: (words, started in the background with ``&``)."""
    joined = block.text.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        background = words[-1] == "&"
        out.append((words[:-1] if background else words, background))
    return out


def prepare_folder(folder: Path) -> None:
    """What a reader has in the folder they run the README's commands in."""
    (folder / "examples").symlink_to(REPO / "examples")
    (folder / "secret.txt").write_text("a shared secret of the README's commands\n")


def executable(words: list[str]) -> list[str]:
    assert words[0] in LAUNCHERS, f"{words[0]!r}: no launcher the README test knows"
    return [sys.executable if words[0] == "python" else str(BIN / words[0]), *words[1:]]


def launch_env() -> dict[str, str]:
    """The reader's environment, with a free port for plain torchrun's store."""
    return {**os.environ, "PET_MASTER_PORT": str(free_port())}


def run(words: list[str], cwd: Path, log: Path, timeout: float) -> None:
    """Run ``words`` (a launcher and its arguments) to its end; it must exit 0."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            executable(words),
            cwd=cwd,
            env=launch_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{shlex.join(words)} ran past {timeout:g}s:\n{tail(log)}"
            ) from None
        assert code == 0, f"{shlex.join(words)} exited with {code}:\n{tail(log)}"
    finally:
        kill_session(proc.pid)
        proc.wait(10)


class Servers:
    """``gradhub serve`` processes started for one block; stopped on the way out."""

    def __init__(self) -> None:
        self.procs: list[tuple[subprocess.Popen[bytes], Path, str]] = []

    def start(self, words: list[str], cwd: Path, log: Path, timeout: float = 60) -> None:
        with log.open("w") as out:
            proc = subprocess.Popen(
                executable(words), cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.procs.append((proc, log, shlex.join(words)))
        deadline = time.monotonic() + timeout
        while "listening on" not in log.read_text():
            assert proc.poll() is None, f"{shlex.join(words)} exited:\n{tail(log)}"
            assert time.monotonic() < deadline, f"{shlex.join(words)}: no listening:\n{tail(log)}"
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM each server; each must exit 0 within 30 s."""
        failures = []
        for proc, log, command in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)
            try:
                code = proc.wait(30)
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                failures.append(f"{command} ended with {code}:\n{tail(log)}")
        for proc, _, _ in self.procs:
            kill_session(proc.pid)
            proc.wait(10)
        self.procs.clear()
        assert not failures, "\n".join(failures)


def free_ports(block: Block) -> dict[str, str]:
    """A free port for every port of a ``tcp://`` address in the block."""
    ports = sorted(set(re.findall(r"tcp://[^\s:]+:(\d+)", block.text)))
    return {port: str(free_port()) for port in ports}


def with_ports(words: list[str], ports: dict[str, str]) -> list[str]:
    return [
        re.sub(
            r"(tcp://[^\s:]+:)(\d+)", lambda m: m.group(1) + ports.get(m.group(2), m.group(2)), w
        )
        for w in words
    ]


def run_commands(block: Block, folder: Path, timeout: float) -> None:
    """Every command of a shell block, in order, in ``folder`` (see the module doc)."""
    ports = free_ports(block)
    servers = Servers()
    try:
        for i, (words, background) in enumerate(commands(block)):
            words = with_ports(words, ports)
            log = folder / f"command-{i}.log"
            if words[:2] == ["gradhub", "serve"]:
                servers.start(words, folder, log)
            else:
                assert not background, f"{block.name}: only gradhub serve runs in the background"
                run(words, folder, log, timeout)
    finally:
        servers.stop()


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
