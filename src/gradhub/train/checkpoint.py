"""Checkpoints: atomic per-rank files, and agreement on which step to resume.

Every rank writes its own file ``step-<step>.rank<r>.pt`` (the model, the
strategy's state: optimizer state or its shard, counters). A file is written
to a temporary name in the same folder, flushed, fsync'ed and renamed over the
final name, then the folder is fsync'ed: a reader sees the old file or the new
one, never half of one. The last ``keep`` steps are kept, so a job killed
while some ranks had written step s and others had not can still resume from
the step before, which every rank has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from gradhub._atomic import atomic_torch_save

_NAME = re.compile(r"^step-(\d+)\.rank(\d+)\.pt$")


@dataclass(kw_only=True)
class CheckpointDir:
    """The checkpoint files of one rank in one folder."""

    path: Path
    """Folder shared by every rank of the job."""
    rank: int
    """Whose files these are."""
    keep: int = 2
    """How many of the latest steps to keep (>= 2 so a torn save can fall back)."""

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        if self.keep < 2:
            raise ValueError(f"keep must be >= 2 so a torn save can fall back, got {self.keep}")

    def file(self, step: int) -> Path:
        return self.path / f"step-{step:08d}.rank{self.rank}.pt"

    def steps(self) -> list[int]:
        """Steps this rank has a complete checkpoint of, ascending."""
        if not self.path.is_dir():
            return []
        found = []
        for entry in self.path.iterdir():
            m = _NAME.match(entry.name)
            if m and int(m.group(2)) == self.rank:
                found.append(int(m.group(1)))
        return sorted(found)

    def save(self, step: int, state: dict[str, Any]) -> Path:
        target = self.file(step)
        atomic_torch_save({"step": step, **state}, target)
        for old in self.steps()[: -self.keep]:
            self.file(old).unlink(missing_ok=True)
        return target

    def load(self, step: int) -> dict[str, Any]:
        state: dict[str, Any] = torch.load(self.file(step), map_location="cpu", weights_only=False)
        return state


def common_step(steps_per_rank: list[list[int]]) -> int | None:
    """The latest step that every rank has a checkpoint of, or ``None``."""
    common = set(steps_per_rank[0]) if steps_per_rank else set()
    for steps in steps_per_rank[1:]:
        common &= set(steps)
    return max(common) if common else None
