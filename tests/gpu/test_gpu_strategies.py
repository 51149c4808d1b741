"""Every strategy through ``gradhub.prepare`` on one GPU, against plain training.

A world of 1 (NCCL refuses two ranks on one GPU): the default group
(``"cpu:gloo,cuda:nccl"``) and NCCL alone. The model stays on the rank's GPU.
``allreduce`` is DDP's arithmetic (the README's bit-for-bit promise); ``sharded``
steps flat fp32 slices (float32 rounding at most; seen bit-identical); the
``ps-*`` servers step on their CPU (float32 rounding of a few steps).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from gpu_jobs import STRATEGIES, strategies_job
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.launch import start_server
from harness import run_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    modes = {"ps-async": "async", "ps-sync": "sync", "ps-ssp": "ssp"}
    handles = {s: start_server(ServerConfig(mode=m, workers=1)) for s, m in modes.items()}
    try:
        yield {s: h.address for s, h in handles.items()}
    finally:
        for h in handles.values():
            h.close()


def _equal(got: list[np.ndarray], want: list[np.ndarray], atol: float = 0.0) -> None:
    for g, w in zip(got, want, strict=True):
        if atol == 0:
            assert np.array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=0, atol=atol)


@pytest.mark.parametrize("backend", [None, "nccl"])
def test_every_strategy_trains_as_plain_training_on_one_gpu(
    servers: dict[str, str], backend: str | None
) -> None:
    use = servers if backend is None else {}  # the servers once: the device path is the same
    out = run_ranks(strategies_job, 1, use, backend, timeout=240)[0].value
    assert out["backend"] == (backend or "cpu:gloo,cuda:nccl")
    assert out["device"].startswith("cuda")
    for strategy in [s for s in STRATEGIES if s in out]:
        assert out[f"{strategy}/device"] == out["device"], strategy  # not moved
    _equal(out["allreduce"], out["plain"])
    _equal(out["sharded"], out["plain"], atol=1e-5)
    for strategy in use:
        _equal(out[strategy], out["plain"], atol=1e-5)
