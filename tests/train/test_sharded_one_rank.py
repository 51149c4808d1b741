"""``sharded`` in a job of one rank (the host-overhead benchmark's case) gives
the plain torch run's bits at every step: the gradient buckets' copies, the
pieces' gradients kept from step to step and the paths around them
(:mod:`gradhub.train.strategies.sharded_buckets`) change no bit."""

from __future__ import annotations

from harness import run_ranks
from sharded_one_rank_jobs import PLAN, same_bits_as_plain


def test_every_step_has_the_plain_runs_bits() -> None:
    (result,) = run_ranks(same_bits_as_plain, 1, "float32", timeout=120)
    assert result.value == [True] * len(PLAN), list(zip(PLAN, result.value, strict=True))
