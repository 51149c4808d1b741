"""Atomic checkpoint files for parameter servers.

:func:`save` writes to a temporary file in the target directory, flushes and
``fsync``s it, renames it over the target (atomic on POSIX) and ``fsync``s the
directory, so a crash leaves either the old checkpoint or the new one, never
a torn file. :func:`load` reads with ``torch.load(weights_only=True)``: a
checkpoint holds tensors and plain containers only, never pickled code.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def save(state: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write ``state`` to ``path`` atomically."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The state saved at ``path``, or ``None`` when there is none."""
    target = Path(path)
    if not target.exists():
        return None
    state: dict[str, Any] = torch.load(target, map_location="cpu", weights_only=True)
    return state
