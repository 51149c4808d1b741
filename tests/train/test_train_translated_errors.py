"""Low-level failures raised as the errors.py class that names the cause (one job)."""

from __future__ import annotations

import pytest

from harness import run_ranks
from translated_errors_job import translated_errors_job


@pytest.mark.slow
def test_low_level_failures_are_raised_as_gradhub_errors_naming_the_cause() -> None:
    first, second = (r.value for r in run_ranks(translated_errors_job, 2, timeout=120))
    for values in (first, second):
        assert values["bucket_work"] is False  # a timeout is a result, not a message to parse
        kind, text = values["bucket"]
        assert kind == "CollectiveTimeoutError", text
        assert "all_reduce at step 0 of strategy 'allreduce' timed out after 0.3s" in text
    kind, text = second["checkpoint"]
    assert kind == "CollectiveTimeoutError", text
    assert (
        "broadcast at the choice of the checkpoint to resume from timed out after 3s "
        "waiting for rank(s) 0 (not entered the operation" in text
    )
