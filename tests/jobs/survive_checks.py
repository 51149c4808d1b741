"""What the survival tests share: launching ``survive_job.py`` under ``gradhub
run --survive``, its single-process reference, and the checks of the survivors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

JOB = str(Path(__file__).with_name("survive_job.py"))
STEPS = 32
TOLERANCE = 1e-5


def run_job(out: Path, workers: int, *args: str, launch: tuple[str, ...] = ()) -> int:
    """``gradhub run -n workers --survive`` of the job; its exit code."""
    cmd = [sys.executable, "-m", "gradhub.cli.main", "run", "-n", str(workers), "--survive"]
    done = subprocess.run(
        [*cmd, *launch, JOB, "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    (out.parent / f"{out.name}.log").write_text(done.stdout + done.stderr)
    return done.returncode


def reference(out: Path, *args: str) -> dict[str, torch.Tensor]:
    """One process (no launcher: a job of one rank) on the same global batches."""
    subprocess.run([sys.executable, JOB, "--out", str(out), *args], check=True, timeout=300)
    state: dict[str, torch.Tensor] = torch.load(out / "member-0.pt")
    return state


def members(out: Path) -> dict[int, dict[str, Any]]:
    found = {}
    for path in sorted(out.glob("member-*.json")):
        report = json.loads(path.read_text())
        report["params"] = torch.load(out / f"member-{report['member']}.pt")
        found[report["member"]] = report
    return found


def check_survivors(
    out: Path, survivors: list[int], want: dict[str, torch.Tensor], world_size: int = 0
) -> None:
    found = members(out)
    assert sorted(found) == survivors
    first = found[survivors[0]]["params"]
    for m in found.values():
        assert m["pid_start"] == m["pid_end"]
        assert m["committed_steps"] == STEPS
        assert m["world_size"] == (world_size or len(survivors))
        for name, value in m["params"].items():
            assert torch.equal(value, first[name]), f"member {m['member']}: {name} differs"
    for name, value in first.items():
        diff = (value - want[name]).abs().max().item()
        assert diff <= TOLERANCE, f"{name}: {diff:.2e} from the single process"
    ranks = sorted(m["rank"] for m in found.values())
    assert ranks == list(range(len(survivors)))  # dense, in the old order:
    assert [m["rank"] for _, m in sorted(found.items())] == ranks


def check_ps_sync(
    found: dict[int, dict[str, Any]],
    want: dict[str, torch.Tensor],
    updates: int,
    failed_steps: int | None = None,
) -> None:
    """Under ps-sync: the servers made ``updates`` updates (one per key and step),
    each member (``failed_steps`` redone, where given) within :data:`TOLERANCE` of
    the single process ``want``."""
    for m in found.values():
        assert m["pushes"]["updates"] == updates, m["pushes"]
        if failed_steps is not None:
            assert m["failed_steps"] == failed_steps
        for name, value in m["params"].items():
            diff = (value - want[name]).abs().max().item()
            assert diff <= TOLERANCE, f"{name}: {diff:.2e} from the single process"
