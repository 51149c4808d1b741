"""A local error (bad input the calling rank can see) raises on that rank, from the
operation call, before anything is sent; the group stays usable (as on gloo)."""

from __future__ import annotations

import pytest
from backend_error_jobs import local_errors_keep_the_group

from harness import run_ranks


@pytest.mark.slow
def test_a_local_error_is_raised_from_the_call_and_leaves_the_group_usable() -> None:
    results = run_ranks(local_errors_keep_the_group, 2, timeout=120)
    for r in results:
        assert r.value["avg"].startswith(f"[rank {r.rank}] allreduce: ReduceOp.AVG needs ")
        assert "- help: reduce with ReduceOp.SUM and divide" in r.value["avg"]
        assert len(r.value["checked"]) == 10
        assert r.value["transport"] == "shm"
    refused = results[0].value["one sided"]
    assert len(refused) == 11
    assert "ReduceOp.BAND needs integer or bool tensors" in refused["float BAND"]
    assert "torch.uint16 tensors are not supported" in refused["uint16"]
    assert "expected torch.float32 of shape [8]" in refused["all_gather size"]
    assert "root rank 2 is not a rank of this group of 2" in refused["broadcast root"]
    assert "split sizes [1, 1] of the output" in refused["all_to_all splits"]
