"""Parameter-server payloads through the shared arena of a client and a server on
one host: the same values as the ZeroMQ path, signatures that cover the arena,
and what a killed client or server leaves behind (nothing)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from gradhub import (
    AuthenticationError,
    NonFiniteError,
    ProtocolError,
    RemoteParameterServer,
    ServerConfig,
    WorkerFailedError,
    start_server,
)
from gradhub.ps.wire import arena, protocol
from gradhub.ps.wire.protocol import Header, Op
from harness import wait_until

pytestmark = pytest.mark.skipif(not arena.enabled(True), reason="needs memfd and send_fds")

SECRET = "arena secret"


def _run(address: str, *, use_arena: bool, worker_id: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (300, 70), "b": (5,), "c": (64, 1024)}  # 84 KB, 20 B, 256 KB
    with RemoteParameterServer(
        address,
        worker_id=worker_id,
        secret=SECRET,
        timeout=20,
        arena=use_arena,
        arena_min_bytes=1024,
    ) as ps:
        assert ps._channel.arena_in_use(0) is False  # set up by the first hello
        for key, shape in shapes.items():
            ps.init(key, torch.randn(shape, generator=gen))
        assert ps._channel.arena_in_use(0) is use_arena
        for step in range(3):
            futures = [
                ps.push(key, torch.randn(shape, generator=gen), priority=step)
                for key, shape in shapes.items()
            ]
            for f in futures:
                f.result(20)
        bad = torch.zeros(shapes["c"])
        bad[-1, -1] = float("nan")  # in the last chunk the client copies and checks
        with pytest.raises(NonFiniteError):
            ps.push("c", bad)  # refused before anything is sent, its segment given back
        out = {k: torch.empty(s) for k, s in shapes.items()}
        for f in [ps.pull(k, t) for k, t in out.items()]:
            f.result(20)
        counters = ps.stats()[0]["counters"]
    assert counters["push_applied"] == 9 and counters["errors"] == 0
    assert counters["dropped_unauthenticated"] == 0
    if use_arena:  # "b" (20 B) stays on ZeroMQ; the rest went through the arena
        assert counters["arena_payloads"] == 2 * 4 and counters["arena_replies"] == 2
    else:
        assert counters["arena_payloads"] == 0 and counters["arena_replies"] == 0
    return out


def test_arena_and_zeromq_paths_apply_once_and_give_the_same_bits() -> None:
    config = ServerConfig(optimizer="adam", lr=0.01, secret=SECRET)
    with start_server(config, in_thread=True) as a, start_server(config, in_thread=True) as b:
        through_arena = _run(a.address, use_arena=True, worker_id=1)
        through_zmq = _run(b.address, use_arena=False, worker_id=1)
    for key, value in through_zmq.items():
        # the same float operations on the same bytes, whichever way they travelled
        assert torch.equal(value, through_arena[key]), key


def test_a_caller_sends_and_receives_its_own_request() -> None:
    with (
        start_server(ServerConfig(optimizer="sgd", lr=1.0), in_thread=True) as server,
        RemoteParameterServer(server.address, worker_id=1, timeout=20) as ps,
    ):
        ps.init("w", torch.zeros(1))
        out = torch.empty(1)
        # Holding the sockets' lock keeps the client's I/O thread out: the push and
        # the pull complete only if this thread sends and receives them itself.
        with ps._channel._io:
            ps.push("w", torch.ones(1)).result(10)
            ps.pull("w", out).result(10)
        assert out.item() == -1.0


def test_the_signature_covers_the_bytes_in_the_arena() -> None:
    region = bytearray(torch.arange(4.0).numpy().tobytes())
    view = torch.frombuffer(region, dtype=torch.float32)
    locator = protocol.ARENA_LOCATOR.pack(7, 0, len(region))
    frames = protocol.encode(Header(op=Op.PUSH), "w", view, secret=SECRET.encode(), arena=locator)
    assert bytes(frames[3]) == locator  # the bytes themselves stay in the arena

    def resolve(session: int, loc: bytes) -> memoryview:
        assert loc == locator
        return memoryview(region)

    msg = protocol.decode(frames, secret=SECRET.encode(), arena=resolve)
    assert torch.equal(msg.tensor(), torch.arange(4.0))
    region[5] ^= 1  # another process writes into the arena after the client signed
    with pytest.raises(AuthenticationError):
        protocol.decode(frames, secret=SECRET.encode(), arena=resolve)
    with pytest.raises(ProtocolError, match="arena"):
        protocol.decode(frames, secret=SECRET.encode())  # no arena with this peer


_CHILD = textwrap.dedent(
    """
    import sys, time, torch
    from gradhub import RemoteParameterServer, ServerConfig, start_server
    server = start_server(ServerConfig(optimizer="sgd", lr=1.0), in_thread=True)
    ps = RemoteParameterServer(sys.argv[1], worker_id=5, timeout=30)
    ps.init("big", torch.zeros(1 << 18))
    ps.push("big", torch.ones(1 << 18)).result(30)
    print(server.address, ps._channel.arena_in_use(0), flush=True)
    time.sleep(300)
    """
)


def _arena_maps() -> int:
    return Path("/proc/self/maps").read_text().count("memfd:gradhub-ps")


@pytest.mark.slow
def test_killed_process_frees_its_arena_and_its_peers_go_on() -> None:
    """One child process is a client of a server here and a server of a client here;
    SIGKILLed, it leaves both: the server here frees the child's arena and keeps
    serving, the client here gets a typed error at once, and no mapping or file
    descriptor is left in this process."""
    fds_before = len(os.listdir("/proc/self/fd"))
    with start_server(ServerConfig(optimizer="sgd", lr=1.0), in_thread=True) as here:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, here.address],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        try:
            assert child.stdout is not None
            address, used = child.stdout.readline().split()
            assert used == "True"  # the child's push came through the arena
            client = RemoteParameterServer(address, worker_id=6, timeout=60)
            with client:
                client.init("w", torch.zeros(1 << 16))
                assert client._channel.arena_in_use(0) and _arena_maps() > 0
                child.send_signal(signal.SIGKILL)
                child.wait(30)
                start = time.monotonic()
                with pytest.raises(WorkerFailedError, match="died"):
                    client.pull("w", torch.empty(1 << 16)).result(60)
                assert time.monotonic() - start < 20  # at once, not after the 60 s timeout
                # the server here unmapped the child's segments, the client its own
                assert wait_until(lambda: _arena_maps() == 0, 10)
            with RemoteParameterServer(here.address, worker_id=7, timeout=30) as ps:
                out = torch.empty(1 << 18)
                ps.pull("big", out).result(30)  # still serving; the child's push applied once
                assert torch.equal(out, torch.full((1 << 18,), -1.0))
                assert ps._channel.arena_in_use(0)
        finally:
            child.kill()
            child.wait(30)
            if child.stdout is not None:
                child.stdout.close()
    assert _arena_maps() == 0
    assert len(os.listdir("/proc/self/fd")) <= fds_before
