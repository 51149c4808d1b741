"""One 2-rank job that provokes the low-level failures of training gradhub translates
(run by test_train_translated_errors.py): each is caught where it happens and raised
as the errors.py class that names the cause. (The shared-memory transport's are
tested with it, in tests/transports/.)"""

from __future__ import annotations

import concurrent.futures
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import gradhub
from gradhub.train.checkpoint import CheckpointDir, agreed_checkpoint
from gradhub.train.strategies.allreduce import _FutureWork


def _caught(fn: Any) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


def translated_errors_job(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    rt = gradhub.init(timeout=3.0)
    store = rt.store

    # allreduce: a bucket reduction that does not finish in time (no message-text match).
    bucket = rt.group.sibling()
    op = bucket.begin("all_reduce at step 0 of strategy 'allreduce'", timeout=0.3)
    never: concurrent.futures.Future[None] = concurrent.futures.Future()
    out["bucket_work"] = _FutureWork(never).wait(timedelta(seconds=0.01))  # False: c10d's way
    out["bucket"] = _caught(lambda: bucket.wait(op, _FutureWork(never), None))

    if rank == 0:  # takes part in nothing below; stays up (it hosts the store)
        store.wait(["test/done"], timedelta(seconds=60))
        return out

    # fit: the checkpoint choice broadcast from rank 0, which does not take part.
    with tempfile.TemporaryDirectory() as folder:
        ckpt = CheckpointDir(path=Path(folder), rank=rank)
        out["checkpoint"] = _caught(lambda: agreed_checkpoint(rt, ckpt))
    store.set("test/done", "1")
    return out
