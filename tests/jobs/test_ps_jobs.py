"""Parameter-server jobs: one server process, worker processes on 127.0.0.1.

Gradients are small integers and the optimizer SGD(lr=1), so every expected
value is exact in fp32 (all magnitudes stay far below 2**24): the checks use
``torch.equal``, not a tolerance.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gradhub import RemoteParameterServer, ServerConfig, start_server
from harness import free_port, run_ranks

FAST = {"timeout": 60.0, "heartbeat_interval": 0.2, "retry_interval": 0.5}


def _value(address: str, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    with RemoteParameterServer(address, worker_id=999, timeout=30) as ps:
        out = torch.empty(shape)
        ps.pull(key, out).result(30)
        return out


# ---------------------------------------------------------------- async
def _async_worker(rank: int, world: int, address: str) -> list[float]:
    gen = torch.Generator().manual_seed(rank)
    sums = [0.0, 0.0]
    with RemoteParameterServer(address, worker_id=rank, **FAST) as ps:  # type: ignore[arg-type]
        futures = []
        for i in range(40):
            k = i % 2
            g = torch.randint(-5, 6, (4,), generator=gen).float()
            futures.append((k, g, ps.push(f"w{k}", g, priority=int(g[0]))))
        for k, g, f in futures:
            f.result(60)  # acknowledged
            sums[k] += float(g.sum())
        # a pull sees this worker's own earlier pushes (value moved by at least them)
        out = torch.empty(4)
        ps.pull("w0", out).result(60)
    return sums


@pytest.mark.slow
def test_async_three_workers_exact_sum_of_acknowledged_pushes() -> None:
    with start_server(ServerConfig(optimizer="sgd", lr=1.0, mode="async")) as server:
        with RemoteParameterServer(server.address, worker_id=100, timeout=30) as driver:
            driver.init("w0", torch.full((4,), 1000.0))
            driver.init("w1", torch.full((4,), -1000.0))
        results = run_ranks(_async_worker, 3, server.address, timeout=90)
        w0 = _value(server.address, "w0", (4,))
        w1 = _value(server.address, "w1", (4,))
    # Each worker summed its gradients over all 4 elements; compare totals exactly.
    assert float(w0.sum()) == 4000.0 - sum(r.value[0] for r in results)
    assert float(w1.sum()) == -4000.0 - sum(r.value[1] for r in results)


# ----------------------------------------------------------------- sync
def _expected_sync(rounds: int, live_after: dict[int, int]) -> float:
    """The value after ``rounds`` rounds: round t takes (rank+1)*(t+1) from each live rank."""
    total = 0.0
    for t in range(rounds):
        total += sum((r + 1) * (t + 1) for r, last in live_after.items() if t < last)
    return 100.0 - total


def _sync_worker(rank: int, world: int, address: str, crash_after: int) -> list[float]:
    seen = []
    ps = RemoteParameterServer(address, worker_id=rank, **FAST)  # type: ignore[arg-type]
    out = torch.empty(3)
    for t in range(5):
        if rank == world - 1 and t == crash_after:
            os._exit(17)  # a crash: no goodbye, no more heartbeats
        ps.push("w", torch.full((3,), float((rank + 1) * (t + 1)))).result(60)
        ps.pull("w", out).result(60)
        seen.append(float(out[0]))
    ps.close()
    return seen


@pytest.mark.slow
def test_sync_rounds_and_a_killed_worker() -> None:
    """Rounds 0-1 with all three workers: each pull shows exactly the round's sum.
    Then rank 2 crashes; after the heartbeat timeout the server stops waiting for
    it and the two others finish rounds 2-4 on their own."""
    config = ServerConfig(optimizer="sgd", lr=1.0, mode="sync", workers=3, heartbeat_timeout=1.5)
    with start_server(config) as server:
        with RemoteParameterServer(server.address, worker_id=100, timeout=30) as driver:
            driver.init("w", torch.full((3,), 100.0))
        start = time.monotonic()
        results = run_ranks(_sync_worker, 3, server.address, 2, timeout=90, check=False)
        elapsed = time.monotonic() - start
        with RemoteParameterServer(server.address, worker_id=100, timeout=30) as driver:
            stats = driver.stats()[0]
    assert results[2].exitcode == 17
    assert results[0].ok and results[1].ok, [r.error for r in results]
    live = {0: 99, 1: 99, 2: 2}  # rank 2 took part in rounds 0 and 1 only
    for r in results[:2]:
        assert r.value == [_expected_sync(t + 1, live) for t in range(5)]
    # rank 2 first; ranks 0 and 1 later too, once they finished and went quiet
    assert stats["counters"]["workers_dropped"] >= 1
    assert elapsed < 60


# -------------------------------------------------------------- restart
def _restart_worker(rank: int, world: int, address: str) -> float:
    total = 0.0
    with RemoteParameterServer(address, worker_id=rank, **FAST) as ps:  # type: ignore[arg-type]
        for i in range(200):
            g = float(i % 5 + 1)
            ps.push("w", torch.full((2,), g)).result(60)
            total += g  # acknowledged: it must survive the server's crash
            time.sleep(0.005)
    return total


@pytest.mark.slow
def test_server_killed_and_restarted_from_checkpoint_loses_no_acknowledged_push(
    tmp_path: Path,
) -> None:
    config = ServerConfig(
        bind=f"tcp://127.0.0.1:{free_port()}",
        optimizer="sgd",
        lr=1.0,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=0.3,
    )
    server = start_server(config)
    results: list[Any] = []
    try:
        with RemoteParameterServer(server.address, worker_id=100, **FAST) as driver:  # type: ignore[arg-type]
            driver.init("w", torch.zeros(2))
            jobs = threading.Thread(
                target=lambda: results.extend(
                    run_ranks(_restart_worker, 2, server.address, timeout=120)
                )
            )
            jobs.start()
            while driver.stats()[0]["counters"]["push_applied"] < 100:
                time.sleep(0.05)
            server.kill()  # SIGKILL: no last checkpoint
            server = start_server(config)
            jobs.join(150)
            assert not jobs.is_alive()
            out = torch.empty(2)
            driver.pull("w", out).result(60)  # the driver reconnected on its own too
            stats = driver.stats()[0]
    finally:
        server.close()
    assert len(results) == 2
    expected = -sum(r.value for r in results)
    assert out.tolist() == [expected, expected]
    assert stats["counters"]["push_applied"] > 0 and stats["incarnation"]


# ---------------------------------------------------------------- start-up failure
@pytest.mark.slow
def test_server_child_that_dies_before_ready_is_a_clear_error(tmp_path: Path) -> None:
    # Without a main-module guard the spawned child re-runs the script and dies
    # before reporting; the parent must say so instead of raising a bare EOFError.
    script = tmp_path / "unguarded.py"
    script.write_text(
        "from gradhub import ServerConfig, start_server\n"
        "start_server(ServerConfig(optimizer='sgd', lr=1.0), start_timeout=60).close()\n"
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "GradhubError" in result.stderr
    assert "exited before it was ready" in result.stderr
    assert "EOFError" not in result.stderr.splitlines()[-1]
