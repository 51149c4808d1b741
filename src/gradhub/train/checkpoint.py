"""Checkpoints: atomic per-rank files, and agreement on which step to resume.

Every rank writes its own file ``step-<step>.rank<r>.pt`` (the model, the
full optimizer state in the single-process format, the scheduler, the world
size of the job). A file is written to a temporary name in the same folder,
flushed, fsync'ed and renamed over the final name, then the folder is
fsync'ed: a reader sees the old file or the new one, never half of one. The
last ``keep`` steps are kept, so a job killed while some ranks had written
step s and others had not can still resume from the step before, which every
rank has.

A step is complete when every rank of the job that wrote it (its
``world_size``) has its file (:meth:`CheckpointDir.latest_complete`). Each
file holds the whole state, so a job of another world size resumes from it:
rank ``r`` reads the file of rank ``r % world_size``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradhub._atomic import atomic_torch_save
from gradhub.errors import InvalidOptionError

if TYPE_CHECKING:
    from gradhub.runtime import Runtime

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
            raise InvalidOptionError(
                f"keep must be >= 2 so a torn save can fall back, got {self.keep}"
            )

    def file(self, step: int, rank: int | None = None) -> Path:
        """The file of ``step`` written by ``rank`` (default: this rank)."""
        return self.path / f"step-{step:08d}.rank{self.rank if rank is None else rank}.pt"

    def ranks_by_step(self) -> dict[int, set[int]]:
        """Every file in the folder: step -> the ranks that wrote it."""
        found: dict[int, set[int]] = {}
        if self.path.is_dir():
            for entry in self.path.iterdir():
                m = _NAME.match(entry.name)
                if m:
                    found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
        return found

    def steps(self) -> list[int]:
        """Steps this rank has a complete checkpoint of, ascending."""
        return sorted(s for s, ranks in self.ranks_by_step().items() if self.rank in ranks)

    def latest_complete(self) -> tuple[int, int] | None:
        """``(step, world_size)`` of the latest step that every rank of the job
        that wrote it has a file of; ``None`` if there is none."""
        by_step = self.ranks_by_step()
        for step in sorted(by_step, reverse=True):
            ranks = by_step[step]
            if 0 not in ranks:
                continue
            world = int(self.load(step, rank=0).get("world_size", max(ranks) + 1))
            if ranks >= set(range(world)):
                return step, world
        return None

    def save(self, step: int, state: dict[str, Any]) -> Path:
        target = self.file(step)
        atomic_torch_save({"step": step, **state}, target)
        for old in self.steps()[: -self.keep]:
            self.file(old).unlink(missing_ok=True)
        return target

    def discard_after(self, step: int) -> None:
        """Delete this rank's checkpoints of steps after ``step`` (a resumed job
        writes those steps again; the old files must not mix with the new ones)."""
        for later in self.steps():
            if later > step:
                self.file(later).unlink(missing_ok=True)

    def load(self, step: int, rank: int | None = None) -> dict[str, Any]:
        """The state in the file of ``step`` written by ``rank`` (default: this rank)."""
        state: dict[str, Any] = torch.load(
            self.file(step, rank), map_location="cpu", weights_only=False
        )
        return state


def agreed_checkpoint(rt: Runtime, ckpt: CheckpointDir) -> tuple[int, int] | None:
    """(step, ranks that wrote it) of the latest checkpoint every rank of its job
    finished, or ``None``: rank 0 reads the folder (shared by the ranks: one reader
    decides) and sends its choice to every rank, within the runtime's timeout (a rank
    that does not take part is named in a ``CollectiveTimeoutError``)."""
    found = ckpt.latest_complete() if rt.is_main else None
    choice = torch.tensor(found if found is not None else (-1, 0), device=rt.device)
    if rt.world_size > 1:
        where = "the choice of the checkpoint to resume from"
        rt.wait(
            rt.collective(
                "broadcast", lambda: dist.broadcast(choice, 0, async_op=True), where=where
            )
        )
    step, written_by = (int(v) for v in choice.tolist())
    return None if step < 0 else (step, written_by)
