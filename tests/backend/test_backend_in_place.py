"""Small operations of the gradhub backend run on the calling thread where its
worker is idle; anything else runs on the worker, in call order."""

from __future__ import annotations

import pytest
from backend_in_place_jobs import where_operations_run

from harness import run_ranks


@pytest.mark.slow
def test_small_operations_run_in_place_only_where_the_worker_is_idle() -> None:
    for r in run_ranks(where_operations_run, 2, timeout=120):
        assert r.value["order"] == ["small", "large", "slow", "behind", "inference"]
        assert r.value["here"] == ["small"]
        assert all(r.value["seen"].values()) and len(r.value["seen"]) == 7, r.value["seen"]
