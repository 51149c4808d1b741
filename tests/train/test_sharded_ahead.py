"""``sharded``'s update taken during the backward (:mod:`gradhub.train.strategies.sharded_ahead`).

The same script with ``step_ahead`` on and off ends every step with the
same parameters and optimizer state, to the bit: where the update taken
aside is kept and where the script does something between backward and step
that makes it drop it. And it is taken during the backward: the first
buckets' new weights are all-gathered before the backward reaches the
first block (shown by order, as in test_overlap.py).
"""

from __future__ import annotations

import pytest

from harness import run_ranks
from sharded_ahead_jobs import PLAN, same_bits_either_way, weights_against_backward


@pytest.mark.slow
@pytest.mark.parametrize("name", ["SGD", "AdamW"])
def test_the_update_taken_during_the_backward_gives_the_same_bits(name: str) -> None:
    results = run_ranks(same_bits_either_way, 2, name, False, timeout=180)
    steps = len(PLAN) - PLAN.count("no step")
    for r in results:
        assert r.value["equal"] == [True] * steps, f"rank {r.rank}: {r.value}"
        assert r.value["moved"]
        # Kept at the plain steps, not where the script changed something (nor
        # the step paused after each of those): 'clip', 'lr', 'load' drop it.
        assert 6 <= r.value["kept"] <= steps - 3, f"rank {r.rank}: {r.value}"


@pytest.mark.slow
def test_a_parameter_no_rank_used_keeps_the_update_at_the_step() -> None:
    results = run_ranks(same_bits_either_way, 2, "AdamW", True, timeout=180)
    for r in results:
        assert all(r.value["equal"]), f"rank {r.rank}: {r.value}"
        assert r.value["kept"] == 0  # the unused parameter is not stepped: never kept


@pytest.mark.slow
def test_first_buckets_new_weights_are_gathered_before_the_backward_reaches_the_first_block() -> (
    None
):
    results = run_ranks(weights_against_backward, 2, timeout=120)
    for r in results:
        backward, gathers = r.value["backward"], r.value["gathers"]
        blocks = r.value["blocks"]
        assert sorted(backward) == list(range(blocks))
        last_block_starts = backward[0]  # block 0's backward runs last
        weights = [(a, b) for name, a, b in gathers if name.startswith("weights")]
        assert len(weights) == blocks, f"rank {r.rank}: {gathers}"
        done_before = [b for _, b in weights if b < last_block_starts]
        # Blocks blocks-1 .. 2 are stepped and gathered while the blocks below sleep.
        assert len(done_before) >= blocks - 2, f"rank {r.rank}: {backward}, {gathers}"
        assert not [n for n, _, _ in gathers if n == "get_weights"], gathers
        assert r.value["kept"] == 3  # every step kept it
