"""No host synchronisation in a steady-state step (DESIGN 19's rule), as DDP.

One rank on one GPU, the default group; a step after three warm-up steps
runs under ``torch.cuda.set_sync_debug_mode("error")``: any
``cudaStreamSynchronize``, ``item()`` or blocking copy in the strategy raises,
and the job returns the traceback. This is the target the strategies are
being brought to; it is not marked as expected to fail.
"""

from __future__ import annotations

import pytest

from gpu_jobs import no_sync_job
from harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("strategy", ["allreduce", "sharded"])
def test_a_steady_state_step_never_waits_for_the_gpu(strategy: str) -> None:
    result = run_ranks(no_sync_job, 1, strategy, timeout=120)[0].value
    assert result == "no sync", result
