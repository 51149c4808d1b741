"""Metrics as JSON lines: one file per rank in the run folder.

Each line is one record: ``{"kind": "step" | "epoch" | "summary", "rank": r,
"step": ..., "epoch": ..., "loss": ..., "accuracy": ..., ...}``. Files are
appended to (a resumed job continues the same file) and flushed per record,
so a killed job keeps what it logged. ``gradhub plot RUN_DIR`` reads them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, TextIO


def metrics_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"metrics.rank{rank}.jsonl"


class MetricsWriter:
    """Appends JSON-lines records for one rank; a no-op without a run folder."""

    def __init__(self, run_dir: Path | None, rank: int) -> None:
        self.rank = rank
        self.path = metrics_file(run_dir, rank) if run_dir is not None else None
        self._file: TextIO | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")

    def write(self, kind: str, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"kind": kind, "rank": self.rank, "time": round(time.time(), 3), **fields}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """Every rank's records under ``run_dir`` (not recursive), by rank."""
    out: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(Path(run_dir).glob("metrics.rank*.jsonl")):
        rank = int(path.name[len("metrics.rank") : -len(".jsonl")])
        with path.open(encoding="utf-8") as f:
            out[rank] = [json.loads(line) for line in f if line.strip()]
    return out
