"""bf16 and fp16 all-reduce, reduce-scatter and all-gather, and broadcast, on
gradhub's transports: gloo's bits with two ranks (on each transport), and
within the bound gradhub.backend.operations states with more."""

from __future__ import annotations

import pytest
from backend_16bit_jobs import sixteen_bit_match_gloo, sixteen_bit_within_bound

from harness import run_ranks


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["auto", "ring", "gloo"])
def test_16bit_collectives_and_broadcast_give_gloos_bits(transport: str) -> None:
    results = run_ranks(sixteen_bit_match_gloo, 2, transport, timeout=240)
    assert results[0].value["transport"] == {"auto": "shm"}.get(transport, transport)
    assert len(results[0].value["checked"]) == len(results[1].value["checked"]) == 25


@pytest.mark.slow
@pytest.mark.parametrize(("world", "per_host"), [(3, 3), (4, 2)], ids=["shm", "hierarchical"])
def test_16bit_sums_of_more_ranks_are_within_the_stated_bound(world: int, per_host: int) -> None:
    results = run_ranks(sixteen_bit_within_bound, world, per_host, timeout=240)
    assert results[0].value["transport"] == ("shm" if per_host == world else "hierarchical")
    assert all(len(r.value["checked"]) == 4 for r in results)
