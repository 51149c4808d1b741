"""Every code block of README.md runs as written, or says why not.

How a block runs, and how the README marks one that does not, is in
``readme_blocks.py``. A new block is run as it is (a ``python`` block, or
commands under ``gradhub``, ``torchrun`` or ``python``); anything else fails
here until it is marked, and the counts below change with every block, so a
block is never left out by accident.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import readme_blocks
from readme_blocks import Block, blocks

# How many blocks of each kind the README has: a new block changes one of them.
COUNTS = {
    "python": 6,  # run as they are: python block.py
    "launched": 8,  # python, the new side of two diffs, DiLoCo: torchrun --nproc-per-node 2
    "commands": 3,  # gradhub serve, gradhub run, torchrun, python examples/...
    "elsewhere": 4,  # multi-node, the trainers, the --max-restarts rerun, --survive
    "not run": 5,  # make, a worker across machines, two lines of a diff, a file tree, DiLoCo LM
}

ALL = blocks()
PYTHON = [b for b in ALL if b.kind in ("python", "launched")]
COMMANDS = [b for b in ALL if b.kind == "commands"]


def test_every_block_is_run_or_marked_with_a_reason() -> None:
    unmarked = [b.name for b in ALL if b.kind == "unmarked"]
    assert not unmarked, (
        f"blocks the README test cannot run; mark them (readme_blocks.py): {unmarked}"
    )
    counts = collections.Counter(b.kind for b in ALL)
    assert dict(counts) == COUNTS, "a block came or went: run it, or mark it, then count it here"
    for b in ALL:
        if b.kind == "not run":
            assert len(b.note or "") > len("not run: ") + 5, f"{b.name}: say why it is not run"
        if b.kind == "commands":
            for words, _ in readme_blocks.commands(b):
                assert words[0] in readme_blocks.LAUNCHERS, f"{b.name}: {words[0]}: mark it"


def test_blocks_run_elsewhere_are_read_by_their_test() -> None:
    for b in ALL:
        if b.kind != "elsewhere":
            continue
        key, test = readme_blocks.elsewhere(b)
        assert test.is_file(), f"{b.name}: {test} does not exist"
        readers = [f for f in test.parent.glob("*.py") if f"<!-- {key}: " in f.read_text()]
        assert readers, f"{b.name}: nothing in {test.parent} reads the block by <!-- {key}: "


def test_the_parser_finds_indented_blocks_and_their_comments() -> None:
    text = "x\n\n  <!-- run: torchrun --nproc-per-node 2 -->\n  ```python\n  a = 1\n  ```\n"
    (b,) = blocks(text)
    assert (b.line, b.lang, b.text, b.kind) == (4, "python", "a = 1\n", "launched")
    diff = "<!-- run: torchrun --nproc-per-node 3\nNet = 1\n-->\n```diff\n a\n-b\n+c\n```\n"
    (d,) = blocks(diff)
    assert readme_blocks.script(d) == (3, "Net = 1\na\nc\n")


def _all_run(jobs: dict[str, Callable[[], None]], at_once: int) -> None:
    """Run the jobs, ``at_once`` at a time; every failure is reported, each
    under its block's name."""
    with ThreadPoolExecutor(at_once) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
    failed = [f"{name}: {f.exception()}" for name, f in futures.items() if f.exception()]
    assert not failed, "\n\n".join(failed)


def _python(block: Block, folder: Path) -> Callable[[], None]:
    def job() -> None:
        folder.mkdir()
        readme_blocks.run_python(block, folder, timeout=150)

    return job


def _commands(block: Block, folder: Path) -> Callable[[], None]:
    def job() -> None:
        folder.mkdir()
        readme_blocks.prepare_folder(folder)
        readme_blocks.run_commands(block, folder, timeout=150)
        # Each training job writes its metrics into one run folder of its own
        # (examples/train_digits.py names the default one by rank 0's clock).
        jobs = sum("examples/train_digits.py" in w for w, _ in readme_blocks.commands(block))
        runs = sorted(folder.glob("runs/train_digits-*"))
        assert len(runs) == jobs, [str(r) for r in runs]
        for run in runs:
            ranks = {int(re.findall(r"\d+", f.name)[0]) for f in run.glob("metrics.rank*.jsonl")}
            assert ranks and ranks == set(range(len(ranks))), (run, ranks)

    return job


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_python_blocks_run(tmp_path: Path) -> None:
    _all_run({b.name: _python(b, tmp_path / f"line{b.line}") for b in PYTHON}, at_once=1)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_command_blocks_run(tmp_path: Path) -> None:
    # Two at a time: their processes wait (start-up, rendezvous) as much as they compute.
    _all_run({b.name: _commands(b, tmp_path / f"line{b.line}") for b in COMMANDS}, at_once=2)
