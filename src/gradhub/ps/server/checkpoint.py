"""Atomic checkpoint files for parameter servers.

:func:`save` writes to a temporary file in the target directory, flushes and
``fsync``s it, renames it over the target (atomic on POSIX) and ``fsync``s the
directory, so a crash leaves either the old checkpoint or the new one, never
a torn file. A write killed half-way leaves its temporary file behind;
:func:`remove_temporary` (called when a server starts) deletes those of one
checkpoint. :func:`load` reads with ``torch.load(weights_only=True)``: a
checkpoint holds tensors and plain containers only, never pickled code.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from gradhub._atomic import atomic_torch_save


def save(state: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``state`` to ``path`` atomically."""
    atomic_torch_save(state, path)


def remove_temporary(path: str | os.PathLike[str]) -> list[Path]:
    """Delete the temporary files that killed writes of ``path`` left; returns them."""
    target = Path(path)
    if not target.parent.is_dir():
        return []
    removed = []
    for tmp in target.parent.glob(f".{target.name}.*.tmp"):
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def load(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The state saved at ``path``, or ``None`` when there is none."""
    target = Path(path)
    if not target.exists():
        return None
    state: dict[str, Any] = torch.load(target, map_location="cpu", weights_only=True)
    return state
