"""Acknowledged means kept: flush on close, ``--durable``, killed checkpoint writes,
sync rounds with refused pushes and dropped workers.

Every push is a gradient of -1 under SGD(lr=1), so a value is exactly the number
of pushes applied to it (small integers: exact in fp32, compared with ``==``).
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gradhub import RemoteParameterServer, ServerConfig, ShapeMismatchError, start_server
from gradhub.errors import ServerTimeoutError
from gradhub.ps.server.launch import ServerHandle
from harness import free_port

FAST = {"timeout": 30.0, "heartbeat_interval": 0.1, "retry_interval": 0.5}
PUSHES = 20
LAST = 5  # pushes of a fourth worker, after the three have finished


def _config(tmp_path: Path, **kw: object) -> ServerConfig:
    return ServerConfig(
        bind=f"tcp://127.0.0.1:{free_port()}",
        optimizer="sgd",
        lr=1.0,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=3600.0,  # no periodic checkpoint: only what flush/--durable keep
        **kw,  # type: ignore[arg-type]
    )


def _pusher(ps: RemoteParameterServer, close: bool, acked: list[int]) -> None:
    for _ in range(PUSHES):
        ps.push("w", torch.full((3,), -1.0)).result(30)
        acked.append(1)
    if close:
        ps.close()  # flushes: every acknowledged push on disk before it returns


def _value_after_sigkill_and_restart(
    config: ServerConfig, close: bool, then: Callable[[ServerHandle], None] | None = None
) -> list[float]:
    """The value after 3 workers' pushes (closed or not), then a fourth worker's
    (flushed or not, never closed), a SIGKILL and a restart; ``then`` gets the
    restarted server."""
    server = start_server(config)
    try:
        with RemoteParameterServer(server.address, worker_id=100, **FAST) as driver:  # type: ignore[arg-type]
            driver.init("w", torch.zeros(3))
        # Three workers (clients of their own, in threads: a server sees no difference).
        workers = [
            RemoteParameterServer(server.address, worker_id=w, **FAST)  # type: ignore[arg-type]
            for w in range(3)
        ]
        acked: list[int] = []
        threads = [threading.Thread(target=_pusher, args=(ps, close, acked)) for ps in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(acked) == 3 * PUSHES
        # The last to push: what it pushed is on disk only if its own flush put it there.
        last = RemoteParameterServer(server.address, worker_id=3, **FAST)  # type: ignore[arg-type]
        for _ in range(LAST):
            last.push("w", torch.full((3,), -1.0)).result(30)
        if close:
            last.flush()  # returns once the server confirms
            assert last._channel.unsaved() == []
        server.kill()  # SIGKILL: no last checkpoint
        last._channel.close()  # gone without close
        last._closed = True
        for ps in workers:
            if not close:  # gone without close: nothing flushed
                ps._channel.close()
                ps._closed = True
        server = start_server(config)
        out = torch.empty(3)
        with RemoteParameterServer(server.address, worker_id=101, **FAST) as reader:  # type: ignore[arg-type]
            reader.pull("w", out).result(30)
        if then is not None:
            then(server)
        return out.tolist()
    finally:
        server.close()


def _flush_and_close_name_a_stopped_server(server: ServerHandle) -> None:
    """A server that cannot confirm (SIGSTOPped) is named by flush and close, in time."""
    assert server.pid is not None
    ps = RemoteParameterServer(server.address, worker_id=4, **FAST)  # type: ignore[arg-type]
    try:
        ps.push("w", torch.zeros(3)).result(30)  # acknowledged, not on disk
        os.kill(server.pid, signal.SIGSTOP)
        try:
            for call in (ps.flush, ps.close):
                begin = time.monotonic()
                with pytest.raises(ServerTimeoutError) as caught:
                    call(timeout=0.5)
                # Loose: 10x the flush timeout, far below the client's 30 s one.
                assert time.monotonic() - begin < 5.0, call
                assert caught.value.server == server.address
                assert "did not answer flush within 0.5s" in str(caught.value)
        finally:
            os.kill(server.pid, signal.SIGCONT)
    finally:
        ps.close()  # closed already unless a check above failed


@pytest.mark.slow
def test_flush_and_close_keep_every_acknowledged_push_and_name_a_stopped_server(
    tmp_path: Path,
) -> None:
    value = _value_after_sigkill_and_restart(
        _config(tmp_path), close=True, then=_flush_and_close_name_a_stopped_server
    )
    assert value == [3.0 * PUSHES + LAST] * 3


@pytest.mark.slow
def test_durable_server_keeps_every_acknowledged_push_without_close(tmp_path: Path) -> None:
    # The workers exit without close (no flush): only the write-ahead log keeps them.
    value = _value_after_sigkill_and_restart(_config(tmp_path, durable=True), close=False)
    assert value == [3.0 * PUSHES + LAST] * 3


@pytest.mark.slow
def test_server_killed_mid_checkpoint_restarts_from_a_valid_one(tmp_path: Path) -> None:
    config = _config(tmp_path)
    config.checkpoint_every = 0.02
    big = 4 << 20  # 16 MB of fp32: each checkpoint write takes a while
    kills = attempts = acked = 0
    server = start_server(config)
    try:
        ps = RemoteParameterServer(server.address, worker_id=2, **FAST)  # type: ignore[arg-type]
        ps.init("big", torch.zeros(big))
        while kills < 3 and attempts < 40:
            attempts += 1
            pushing = ps.push("big", torch.full((big,), -1.0))
            deadline = time.monotonic() + 20
            while not list(tmp_path.glob(".*.tmp")) and time.monotonic() < deadline:
                time.sleep(0.001)
            server.kill()  # SIGKILL, most likely while the checkpoint is being written
            if list(tmp_path.glob(".*.tmp")):
                kills += 1
            server = start_server(config)  # loads the checkpoint: it must be a valid one
            assert not list(tmp_path.glob(".*.tmp")), "a temporary file survived the start"
            pushing.result(30)  # replayed to the restarted server if it was not yet saved
            acked += 1
            out = torch.empty(big)
            ps.pull("big", out).result(30)
            assert bool((out == float(acked)).all()), (out.min(), out.max(), acked)
        ps.close()
    finally:
        server.close()
    assert kills == 3, f"only {kills} of {attempts} kills landed in a checkpoint write"


@pytest.mark.slow
def test_refused_push_does_not_make_its_worker_a_sync_member() -> None:
    config = ServerConfig(optimizer="sgd", lr=1.0, mode="sync", workers=2, heartbeat_timeout=60)
    with start_server(config, in_thread=True) as server:
        kw = dict(FAST, timeout=10.0)
        with (
            RemoteParameterServer(server.address, worker_id=9, **kw) as bad,  # type: ignore[arg-type]
            RemoteParameterServer(server.address, worker_id=0, **kw) as a,  # type: ignore[arg-type]
            RemoteParameterServer(server.address, worker_id=1, **kw) as b,  # type: ignore[arg-type]
        ):
            a.init("w", torch.zeros(2))
            with pytest.raises(ShapeMismatchError):
                bad.push("w", torch.ones(5)).result(10)
            start = time.monotonic()
            for ps in (a, b):
                ps.push("w", torch.full((2,), -1.0)).result(10)
            out = torch.empty(2)
            a.pull("w", out).result(10)  # the round does not wait for worker 9
            assert out.tolist() == [2.0, 2.0]
            assert time.monotonic() - start < 8  # far below the 60 s heartbeat timeout
            assert a.stats()[0]["registered"] == [0, 1]


ROUNDS = 8


def _sync_worker(ps: RemoteParameterServer, dies_at: float | None, acked: list[int]) -> None:
    out = torch.empty(1)
    for t in range(ROUNDS):
        if dies_at is not None and t == dies_at:
            ps._channel.close()  # a crash: no goodbye, no flush, no more heartbeats
            return
        ps.push("w", torch.full((1,), -1.0)).result(30)
        acked[0] += 1
        if dies_at is not None and t + 0.5 == dies_at:
            ps._channel.close()  # dies after its push was acknowledged, before the pull
            return
        ps.pull("w", out).result(30)


@pytest.mark.slow
@pytest.mark.parametrize("run", range(20))
def test_sync_worker_dropped_mid_round_keeps_its_acknowledged_pushes(run: int) -> None:
    rng = random.Random(run)
    # From round 1 on (a worker that never pushed is never a member: that is a wait
    # for a worker that never joined); t: before round t's push, t + 0.5: after it.
    dies_at = rng.randrange(2, 2 * ROUNDS - 1) / 2
    config = ServerConfig(optimizer="sgd", lr=1.0, mode="sync", workers=3, heartbeat_timeout=0.5)
    with start_server(config, in_thread=True) as server:
        clients = [
            RemoteParameterServer(server.address, worker_id=w, **FAST)  # type: ignore[arg-type]
            for w in range(3)
        ]
        clients[0].init("w", torch.zeros(1))
        acked = [[0] for _ in clients]
        threads = [
            threading.Thread(target=_sync_worker, args=(c, dies_at if w == 2 else None, acked[w]))
            for w, c in enumerate(clients)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        out = torch.empty(1)
        clients[0].pull("w", out).result(30)
        for c in clients[:2]:
            c.close()
        clients[2]._closed = True  # its channel is gone already
    assert acked[0][0] == acked[1][0] == ROUNDS
    assert out.item() == 2 * ROUNDS + acked[2][0], (dies_at, acked)


def reopened(path: Path) -> tuple[list[list[bytes]], int]:
    """The records and the end of the log at ``path``, as a restarted server reads them."""
    from gradhub.ps.server.wal import WriteAheadLog

    log = WriteAheadLog(path)
    try:
        return list(log.records()), log.size
    finally:
        log.close()


def test_write_ahead_log_round_trip_empty_frames_and_torn_tail(tmp_path: Path) -> None:
    from gradhub.ps.server.wal import PREALLOCATE, WriteAheadLog

    path = tmp_path / "a.wal"
    records = [[b"head", b"", b"", b"payload" * 100], [b"h2", b"", b"", b""], [b"x" * 70_000]]
    log = WriteAheadLog(path)
    for r in records[:2]:
        log.append(r)
    log.commit()  # one sync for both (group commit)
    log.append(records[2])
    log.commit()
    assert log.commits == 2
    log.close()
    found, end = reopened(path)
    assert found == records
    assert path.stat().st_size >= end + PREALLOCATE // 2  # zeros written ahead

    # A crash during a write leaves a torn record where the log ends, its
    # blocks on disk in any order: its header, or only a later block of it.
    for torn in (b"\x10\x00\x00\x00torn", bytes(8) + b"a later block"):
        with open(path, "r+b") as f:
            f.seek(end)
            f.write(torn)
        assert reopened(path) == (records, end)
        tail = path.read_bytes()[end:]
        assert tail.count(0) == len(tail) >= PREALLOCATE // 2  # cut off, zeros again
        log = WriteAheadLog(path)
        log.append([b"after"])
        log.commit()
        log.close()
        records.append([b"after"])
        found, end = reopened(path)
        assert found == records

    # A record larger than the zeros ahead grows the file (and writes zeros past it).
    log = WriteAheadLog(path)
    log.append([b"y" * (PREALLOCATE + 1)])
    log.commit()
    log.close()
    found, end = reopened(path)
    assert found == [*records, [b"y" * (PREALLOCATE + 1)]]
    assert path.stat().st_size >= end + PREALLOCATE // 2

    log = WriteAheadLog(path)
    log.reset()
    assert log.size == 0
    log.append([b"one"])
    log.commit()
    log.close()
    assert reopened(path)[0] == [[b"one"]]
