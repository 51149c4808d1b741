"""Communication runs beside the backward, not after it.

With a backward that leaves the CPU idle (each block sleeps, as the host
waits for a GPU), a bucket's reduction must start from the backward hooks
and be done while earlier layers still compute. Shown by order, not by
time: the reductions of the buckets ready first (the last blocks') start and
finish before the backward reaches the first block. The time it saves is
measured in benchmarks/training.py and benchmarks/backend.py (sleeping rows).
"""

from __future__ import annotations

import pytest

from harness import run_ranks
from overlap_jobs import BLOCKS, reductions_against_backward


@pytest.mark.slow
@pytest.mark.parametrize("how", ["allreduce", "sharded", "DDP on gradhub"])
def test_first_buckets_are_reduced_before_the_backward_reaches_the_first_block(
    how: str,
) -> None:
    results = run_ranks(reductions_against_backward, 2, how, timeout=120)
    for r in results:
        backward, calls = r.value["backward"], r.value["calls"]
        assert sorted(backward) == list(range(BLOCKS))
        last_block_starts = backward[0]  # block 0's backward runs last
        # A bucket's sum: a reduce-scatter, or a whole all-reduce (small plain vectors).
        scatters = [(a, b) for kind, a, b in calls if kind in ("reduce_scatter", "all_reduce")]
        assert len(scatters) >= BLOCKS, f"rank {r.rank}: {calls}"
        before = [(a, b) for a, b in scatters if b < last_block_starts]
        # Blocks BLOCKS-1 .. 2 finished their backward (and their buckets'
        # reductions) while the blocks below still slept; block 1's bucket is
        # reduced during block 0's backward, block 0's after it.
        assert len(before) >= BLOCKS - 2, (
            f"rank {r.rank}: only {len(before)} reduction(s) done before the last "
            f"block's backward began; block starts {backward}, calls {calls}"
        )
        if how == "sharded":  # each bucket's sums are gathered behind its reduce-scatter
            gathered = [b for kind, _, b in calls if kind == "all_gather" and b < last_block_starts]
            assert len(gathered) >= BLOCKS - 2, f"rank {r.rank}: {calls}"


@pytest.mark.slow
def test_the_order_check_tells_a_step_that_reduces_after_the_backward() -> None:
    # The same record with overlap=False: every reduction after the whole backward.
    results = run_ranks(reductions_against_backward, 2, "allreduce (no overlap)", timeout=120)
    for r in results:
        backward, calls = r.value["backward"], r.value["calls"]
        assert calls and all(a > backward[0] for _, a, _ in calls), f"rank {r.rank}: {calls}"
