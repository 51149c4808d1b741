"""Parameter-server strategies against real server processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import gradhub
from gradhub.ps.config import ServerConfig
from gradhub.ps.launch import ServerHandle, start_server
from gradhub.train.strategies import make_strategy
from harness import run_ranks
from train_helpers import reference_step, sgd, tiny_model, uneven_steps


@pytest.fixture
def sync_server() -> Iterator[ServerHandle]:
    config = ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=0.5, momentum=0.9)
    with start_server(config) as handle:
        yield handle


@pytest.mark.slow
def test_ps_sync_uneven_batches_equal_single_process_steps(sync_server: ServerHandle) -> None:
    # Rank 0 initialises the keys; the servers hold the optimizer.
    options = {"servers": [sync_server.address], "timeout": 30}
    results = run_ranks(uneven_steps, 2, "ps-sync", options, False, timeout=90)
    expected = reference_step(sgd, steps=3)
    for r in results:
        for got, want in zip(r.value, expected, strict=True):
            # The server sums 5/8 * mean5 + 3/8 * mean3 (float32) and runs the same
            # SGD: equal to the 8-sample step up to reordered float32 sums.
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_wrong_mode_and_unreachable_servers_are_clear_errors(sync_server: ServerHandle) -> None:
    runtime = gradhub.init(timeout=10)
    try:
        wrong = make_strategy("ps-async", servers=[sync_server.address], timeout=5)
        with pytest.raises(gradhub.GradhubError, match="needs servers in mode 'async'"):
            wrong.setup(tiny_model(), None, runtime)
        wrong.close()
        gone = make_strategy("ps-sync", servers=["tcp://127.0.0.1:9"], timeout=1)
        with pytest.raises(gradhub.GradhubError, match=r"127.0.0.1:9 unreachable"):
            gone.setup(tiny_model(), None, runtime)
        gone.close()
    finally:
        runtime.close()
