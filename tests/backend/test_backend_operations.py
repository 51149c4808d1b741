"""Every operation of the gradhub backend gives gloo's result (and the same bits on every rank)."""

from __future__ import annotations

import pytest
from backend_jobs import operations_match_gloo

from harness import run_ranks


@pytest.mark.slow
def test_operations_match_gloo() -> None:
    results = run_ranks(operations_match_gloo, 2, timeout=120)
    assert all("device error" in r.value["checked"] for r in results)
    assert "stalled peer named" in results[0].value["checked"]
    assert "silent peer named" in results[0].value["checked"]
    assert all("barrier" in r.value["checked"] for r in results)
    assert "stalled barrier named" in results[0].value["checked"]
