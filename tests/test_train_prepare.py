"""``gradhub.prepare``: the user's own loop under every strategy (real processes)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from gradhub.ps.config import ServerConfig
from gradhub.ps.launch import ServerHandle, start_server
from harness import run_ranks
from prepare_jobs import own_loop, single_process


@pytest.fixture
def sync_server() -> Iterator[ServerHandle]:
    with start_server(ServerConfig(mode="sync", workers=2)) as handle:  # takes the script's spec
        yield handle


def _same(got: list[np.ndarray], want: list[np.ndarray], atol: float) -> None:
    for g, w in zip(got, want, strict=True):
        if atol == 0:
            assert np.array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=0, atol=atol)


def test_own_loop_matches_ddp_and_single_process(sync_server: ServerHandle) -> None:
    cases = [
        ("allreduce", "mlp", "sgd", {"bucket_mb": 0.0005}),  # several buckets, overlapped
        ("allreduce", "cnn", "sgd", {}),
        ("sharded", "mlp", "sgd", {}),
        ("sharded", "cnn", "sgd", {}),
        ("ps-sync", "mlp", "adam", {"servers": [sync_server.address], "timeout": 30}),
    ]
    results = run_ranks(own_loop, 2, cases, timeout=150)
    for r in results:
        out = r.value
        for kind in ("mlp", "cnn"):
            # Same bucketing of the same sums as DDP (grad / 2, then sum): the same bits.
            _same(out[f"allreduce/{kind}"], out[f"ddp/{kind}"], atol=0)
            # Slices summed and normed separately: float32 rounding only.
            _same(out[f"sharded/{kind}"], out[f"ddp/{kind}"], atol=1e-5)
        # The servers ran the script's Adam on the summed halves: the single-process
        # Adam on the 6-sample batches, same schedule, up to float32 rounding.
        _same(out["ps-sync/mlp"], single_process("mlp", "adam", 2), atol=1e-5)
        # and the LR change / schedule: allreduce equals the single process too
        _same(out["allreduce/mlp"], single_process("mlp", "sgd", 2), atol=1e-5)
    torch.testing.assert_close(
        results[0].value["sharded/mlp"][0], results[1].value["sharded/mlp"][0]
    )
