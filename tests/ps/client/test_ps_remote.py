"""RemoteParameterServer against real server processes on 127.0.0.1: errors, security,
garbage, duplicates, slicing, ssp and the ``gradhub serve`` command."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from gradhub import (
    AuthenticationError,
    ClosedError,
    DuplicateParameterError,
    RemoteParameterServer,
    ServerConfig,
    ShapeMismatchError,
    UnknownParameterError,
    start_server,
)
from gradhub.cli.main import main as cli_main
from gradhub.ps.server.launch import ServerHandle
from gradhub.ps.wire import protocol
from gradhub.ps.wire.protocol import Header, Op

SECRET = "correct horse"


@pytest.fixture(scope="module")
def signed_server() -> Iterator[ServerHandle]:
    with start_server(ServerConfig(optimizer="sgd", lr=1.0, secret=SECRET)) as handle:
        yield handle


def _client(handle: ServerHandle, worker_id: int, **kw: object) -> RemoteParameterServer:
    kw.setdefault("timeout", 10)
    return RemoteParameterServer(handle.address, worker_id=worker_id, secret=SECRET, **kw)  # type: ignore[arg-type]


@pytest.mark.slow
def test_typed_errors_through_the_client(signed_server: ServerHandle) -> None:
    ps = _client(signed_server, 1)
    with ps:
        ps.init("errs", torch.zeros(3))
        with pytest.raises(DuplicateParameterError, match="errs"):
            ps.init("errs", torch.zeros(3))
        with _client(signed_server, 11, timeout=1.0) as quick:  # waits 1 s for an init
            with pytest.raises(UnknownParameterError, match="missing"):
                quick.pull("missing", torch.zeros(3)).result(10)
            with pytest.raises(UnknownParameterError):
                quick.push("missing", torch.zeros(3)).result(10)
        with pytest.raises(ShapeMismatchError, match="errs"):
            ps.push("errs", torch.zeros(4)).result(10)
        with pytest.raises(ShapeMismatchError):
            ps.pull("errs", torch.zeros(2, 2)).result(10)
        out = torch.ones(3)
        ps.pull("errs", out).result(10)
        assert torch.equal(out, torch.zeros(3))  # the failed push changed nothing
    with pytest.raises(ClosedError):
        ps.push("errs", torch.zeros(3))
    ps.close()  # idempotent


@pytest.mark.slow
def test_wrong_secret_rejected_counted_and_server_still_serves(signed_server: ServerHandle) -> None:
    with _client(signed_server, 2) as good:
        before = good.stats()[0]["counters"]["dropped_unauthenticated"]
        with (
            RemoteParameterServer(
                signed_server.address, worker_id=3, secret="wrong", timeout=1.0
            ) as bad,
            pytest.raises(AuthenticationError, match=r"127\.0\.0\.1"),
        ):
            bad.init("sec", torch.zeros(2))
        unsigned = RemoteParameterServer(signed_server.address, worker_id=4, timeout=1.0)
        with unsigned, pytest.raises(AuthenticationError):
            unsigned.pull("sec", torch.zeros(2)).result(5)
        stats = good.stats()[0]
        assert stats["counters"]["dropped_unauthenticated"] > before + 1
        good.init("sec", torch.ones(2))
        out = torch.zeros(2)
        good.pull("sec", out).result(10)
        assert torch.equal(out, torch.ones(2))


@pytest.mark.slow
def test_live_server_survives_10000_random_frames(signed_server: ServerHandle) -> None:
    rng = random.Random(0)
    valid = [
        bytes(memoryview(f))
        for f in protocol.encode(Header(op=Op.PULL), "x", torch.ones(4), secret=SECRET.encode())
    ]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = 0
    sock.connect(signed_server.address)
    try:
        for i in range(10_000):
            kind = i % 3
            if kind == 0:  # random frames
                frames = [rng.randbytes(rng.randrange(0, 300)) for _ in range(rng.randrange(1, 6))]
            else:  # a valid signed message with a byte flipped
                frames = [bytearray(f) for f in valid]
                f = rng.choice([f for f in frames if f])  # the meta frame is empty
                f[rng.randrange(len(f))] ^= 1 + rng.randrange(255)
            sock.send_multipart(frames)
    finally:
        sock.close(linger=10_000)  # deliver every frame before closing
        ctx.term()
    with _client(signed_server, 5) as ps:
        ps.init("alive", torch.arange(3.0))
        out = torch.zeros(3)
        ps.pull("alive", out).result(30)
        assert torch.equal(out, torch.arange(3.0))
        counters = ps.stats()[0]["counters"]
    dropped = sum(v for k, v in counters.items() if k.startswith("dropped_"))
    assert dropped >= 10_000
    assert counters["dropped_unauthenticated"] > 0 and counters["dropped_malformed"] > 0


@pytest.mark.slow
def test_duplicate_sends_applied_once(signed_server: ServerHandle) -> None:
    with _client(signed_server, 6) as ps:
        ps.init("dup", torch.zeros(2))
        before = ps.stats()[0]["counters"]["push_duplicate"]
        exchange = ps._channel._exchange
        send = exchange.send

        def send_three_times(s, req):  # type: ignore[no-untyped-def]
            for _ in range(3):
                send(s, req)

        exchange.send = send_three_times  # type: ignore[method-assign]
        for _ in range(5):
            ps.push("dup", torch.ones(2)).result(10)
        exchange.send = send  # type: ignore[method-assign]
        out = torch.zeros(2)
        ps.pull("dup", out).result(10)
        assert torch.equal(out, torch.full((2,), -5.0))  # SGD(lr=1): 5 pushes of 1
        assert ps.stats()[0]["counters"]["push_duplicate"] - before == 10


def _run_job(addresses: list[str], slice_bytes: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {f"k{i}": (3, i + 1) for i in range(10)}
    shapes["big"] = (1000, 33)  # 132 KB, sliced over the servers
    with RemoteParameterServer(addresses, worker_id=7, timeout=20, slice_bytes=slice_bytes) as ps:
        for key, shape in shapes.items():
            ps.init(key, torch.randn(shape, generator=gen))
        for _step in range(3):
            futures = [
                ps.push(key, torch.randn(shape, generator=gen), priority=-i)
                for i, (key, shape) in enumerate(shapes.items())
            ]
            for f in futures:
                f.result(20)
        out = {k: torch.empty(s) for k, s in shapes.items()}
        for f in [ps.pull(k, t) for k, t in out.items()]:
            f.result(20)
        stats = ps.stats()
    assert all(s["counters"]["errors"] == 0 for s in stats)
    # "big" is stored as one slice per server: 10 keys + n slices in all
    assert sum(s["keys"] for s in stats) == 10 + len(addresses)
    return out


@pytest.mark.slow
def test_two_servers_and_a_sliced_tensor_match_one_server() -> None:
    config = ServerConfig(optimizer="adam", lr=0.05)
    # Servers in threads of this process (real sockets, no interpreter start-up cost).
    with (
        start_server(config, in_thread=True) as a,
        start_server(config, in_thread=True) as b,
        start_server(config, in_thread=True) as single,
    ):
        two = _run_job([a.address, b.address], slice_bytes=64 << 10)
        one = _run_job([single.address], slice_bytes=64 << 10)
    for key in one:
        # Adam is elementwise, so each slice sees the same float operations: bit-identical.
        assert torch.equal(one[key], two[key]), key


@pytest.mark.slow
def test_ssp_fast_worker_blocks_until_slow_catches_up() -> None:
    config = ServerConfig(optimizer="sgd", lr=1.0, mode="ssp", workers=2, max_staleness=1)
    with start_server(config) as server:
        kw = {"timeout": 20.0, "heartbeat_interval": 0.2}
        with (
            RemoteParameterServer(server.address, worker_id=0, **kw) as fast,  # type: ignore[arg-type]
            RemoteParameterServer(server.address, worker_id=1, **kw) as slow,  # type: ignore[arg-type]
        ):
            fast.init("w", torch.zeros(1))
            out = torch.zeros(1)
            fast.push("w", torch.ones(1)).result(10)
            slow.push("w", torch.ones(1)).result(10)
            fast.push("w", torch.ones(1)).result(10)  # fast at step 2, slow at 1: within K=1
            fast.pull("w", out).result(10)
            fast.push("w", torch.ones(1)).result(10)  # fast at 3, slow at 1: 2 ahead
            blocked = fast.pull("w", out)
            time.sleep(0.8)
            assert not blocked.done()
            slow.push("w", torch.ones(1)).result(10)  # slow catches up to 2
            blocked.result(10)
            assert out.item() == -5.0


@pytest.mark.slow
def test_gradhub_serve_command(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    address = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gradhub.cli.main", "serve", "--bind", address, "--lr", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        # Ctrl-C as in a terminal: a suite started in the background (``make test &``)
        # passes its children SIGINT ignored, and Python then keeps ignoring it.
        preexec_fn=_default_sigint,
    )
    try:
        assert proc.stdout is not None
        assert address in proc.stdout.readline()
        with RemoteParameterServer(address, worker_id=1, timeout=60) as ps:
            ps.init("w", torch.ones(2))
            ps.push("w", torch.ones(2)).result(10)
            out = torch.empty(2)
            ps.pull("w", out).result(10)
            assert torch.equal(out, torch.zeros(2))
            waiting = ps.pull("later", torch.empty(1))  # waits for an init that never comes
            with pytest.raises(TimeoutError):
                waiting.result(0.5)  # pending on the server
            start = time.monotonic()
            proc.send_signal(signal.SIGINT)  # Ctrl-C; no checkpoint directory: no restart
            with pytest.raises(ClosedError, match=re.escape(address)):
                waiting.result(30)
            with pytest.raises(ClosedError, match="shut down"):
                ps.push("w", torch.ones(2)).result(30)
            assert time.monotonic() - start < 10  # at once, not after the 60 s timeout
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
        proc.stdout.close()  # type: ignore[union-attr]
    # Refused before anything starts (in this process: no server to run).
    assert cli_main(["serve", "--bind", "tcp://0.0.0.0:1"]) == 2
    assert "secret" in capsys.readouterr().err


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _free_port() -> int:
    from harness import free_port

    return free_port()
