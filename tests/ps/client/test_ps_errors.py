"""Failures that name their cause, fast: each with its class, its message and a loose
time bound (several times the expected time, so a loaded machine cannot fail it)."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gradhub import (
    AuthenticationError,
    ClosedError,
    DtypeMismatchError,
    GradhubTimeoutError,
    LocalParameterServer,
    NonFiniteError,
    RemoteParameterServer,
    ServerConfig,
    ServerUnavailableError,
    start_server,
)
from gradhub.ps.server.launch import ServerHandle
from gradhub.ps.wire.protocol import Op
from harness import free_port

SECRET = "s3cret"


@pytest.fixture(scope="module")
def signed() -> Iterator[ServerHandle]:
    with start_server(ServerConfig(lr=1.0, secret=SECRET), in_thread=True) as handle:
        yield handle


@pytest.fixture(scope="module")
def open_server() -> Iterator[ServerHandle]:
    with start_server(ServerConfig(lr=1.0), in_thread=True) as handle:
        yield handle


@pytest.mark.parametrize("secret", ["wrong", None])
def test_wrong_or_missing_secret_is_an_authentication_error_within_2s(
    signed: ServerHandle, secret: str | None
) -> None:
    ps = RemoteParameterServer(signed.address, worker_id=1, secret=secret, timeout=60)
    start = time.monotonic()
    with ps:
        with pytest.raises(AuthenticationError, match="refused this client's hello") as err:
            ps.init("a", torch.zeros(2))
        assert time.monotonic() - start < 6  # stated bound 2 s; not the 60 s timeout
        assert signed.address in str(err.value) and "secret" in str(err.value)
        with pytest.raises(AuthenticationError):  # later calls fail at once
            ps.pull("a", torch.zeros(2)).result(1)


def test_a_secret_sent_to_a_server_without_one_is_refused(open_server: ServerHandle) -> None:
    with RemoteParameterServer(open_server.address, worker_id=1, secret="x", timeout=60) as ps:
        start = time.monotonic()
        with pytest.raises(AuthenticationError, match="sent with this secret"):
            ps.init("b", torch.zeros(2))
        assert time.monotonic() - start < 6


def test_secret_whitespace_is_stripped_the_same_on_both_sides(tmp_path: Path) -> None:
    from gradhub.ps.server.config import read_secret_file

    path = tmp_path / "secret.txt"
    path.write_text(SECRET + "\n")  # as an editor saves it
    config = ServerConfig(secret=read_secret_file(path))
    with (
        start_server(config, in_thread=True) as server,
        RemoteParameterServer(
            server.address, worker_id=1, secret=path.read_text(), timeout=10
        ) as ps,
    ):
        ps.init("w", torch.ones(2))  # accepted: "s3cret\n" and "s3cret" are one secret


# A host typo (a name that does not resolve: ZeroMQ resolves it in the
# background and retries, as for a server not up yet) is the same error.
@pytest.mark.parametrize("host", ["127.0.0.1", "no-such-host.invalid"])
def test_nothing_listening_is_server_unavailable_within_the_connect_timeout(host: str) -> None:
    address = f"tcp://{host}:{free_port()}"
    with RemoteParameterServer(address, worker_id=1, timeout=60, connect_timeout=1.0) as ps:
        start = time.monotonic()
        with pytest.raises(ServerUnavailableError) as err:
            ps.init("w", torch.zeros(2))
        elapsed = time.monotonic() - start
    assert isinstance(err.value, GradhubTimeoutError)
    assert address in str(err.value) and "gradhub serve" in str(err.value)
    assert 0.9 <= elapsed < 6  # the connect timeout, not the 60 s request timeout


@pytest.mark.parametrize("address", ["localhost:5555", "tcp://127.0.0.1", "http://h:1", ""])
def test_a_malformed_address_lists_the_accepted_forms(address: str) -> None:
    with pytest.raises(ValueError, match=r"tcp://HOST:PORT.*ipc://.*inproc://"):
        RemoteParameterServer(address, worker_id=1)


def test_shutdown_without_checkpoint_fails_pending_and_later_calls_naming_the_server() -> None:
    config = ServerConfig(lr=1.0, mode="sync", workers=2)
    server = start_server(config, in_thread=True)
    with RemoteParameterServer(server.address, worker_id=0, timeout=60) as ps:
        ps.init("w", torch.zeros(1))
        ps.push("w", torch.ones(1)).result(10)
        waiting = ps.pull("w", torch.zeros(1))  # waits for worker 1's push
        start = time.monotonic()
        server.close()
        with pytest.raises(ClosedError, match=server.address.replace(".", r"\.")):
            waiting.result(30)
        with pytest.raises(ClosedError, match="shut down"):
            ps.push("w", torch.ones(1)).result(1)
        assert time.monotonic() - start < 10  # at once, not after the 60 s timeout


def test_shutdown_with_checkpoint_is_waited_for_until_the_restart(tmp_path: Path) -> None:
    config = ServerConfig(
        bind=f"tcp://127.0.0.1:{free_port()}", lr=1.0, checkpoint_dir=str(tmp_path)
    )
    server = start_server(config, in_thread=True)
    with RemoteParameterServer(config.bind, worker_id=0, timeout=60, retry_interval=0.5) as ps:
        ps.init("w", torch.zeros(1))
        server.close()  # says it can be restarted from its checkpoint
        pushed = ps.push("w", torch.ones(1))
        with pytest.raises(TimeoutError):
            pushed.result(1.0)  # still waiting, not failed
        server = start_server(config, in_thread=True)
        try:
            pushed.result(30)
            out = torch.empty(1)
            ps.pull("w", out).result(30)
            assert out.item() == -1.0
        finally:
            ps.close()
            server.close()


def test_sync_wait_timeout_names_the_workers_it_waits_for() -> None:
    config = ServerConfig(lr=1.0, mode="sync", workers=3, heartbeat_timeout=60)
    with (
        start_server(config, in_thread=True) as server,
        RemoteParameterServer(server.address, worker_id=0, timeout=1.5) as a,
        RemoteParameterServer(server.address, worker_id=1, timeout=1.5) as b,
    ):
        a.init("w", torch.zeros(1))
        a.push("w", torch.ones(1)).result(5)
        b.push("w", torch.ones(1)).result(5)
        start = time.monotonic()
        with pytest.raises(GradhubTimeoutError) as err:
            a.pull("w", torch.zeros(1)).result(10)
        assert time.monotonic() - start < 8
        assert "sync round 0 of 'w'" in str(err.value)
        assert "1 worker that never pushed: 1 worker never heard from" in str(err.value)
        assert server.address in str(err.value)


def test_ssp_wait_timeout_names_the_slow_worker() -> None:
    config = ServerConfig(lr=1.0, mode="ssp", workers=2, max_staleness=0, heartbeat_timeout=60)
    with (
        start_server(config, in_thread=True) as server,
        RemoteParameterServer(server.address, worker_id=0, timeout=1.5) as fast,
        RemoteParameterServer(server.address, worker_id=1, timeout=1.5) as slow,
    ):
        fast.init("w", torch.zeros(1))
        slow.push("w", torch.ones(1)).result(5)
        fast.push("w", torch.ones(1)).result(5)
        fast.push("w", torch.ones(1)).result(5)
        with pytest.raises(GradhubTimeoutError, match=r"waits for worker\(s\) 1 \(at step 1\)"):
            fast.pull("w", torch.zeros(1)).result(10)


@pytest.mark.parametrize("kind", ["local", "remote"])
def test_keys_trees_dtypes_and_nonfinite_pushes(kind: str, open_server: ServerHandle) -> None:
    ps = (
        LocalParameterServer()
        if kind == "local"
        else RemoteParameterServer(open_server.address, worker_id=7, timeout=10)
    )
    with ps:
        with pytest.raises(TypeError, match=r"parameter keys are str, got 3"):
            ps.init(3, torch.zeros(2))  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="one key per tensor"):
            ps.init(f"tree-{kind}", {"a": torch.zeros(2)})  # type: ignore[arg-type]
        key = f"k-{kind}"
        ps.init(key, torch.zeros(2))
        with pytest.raises(DtypeMismatchError, match="dtype mismatch"):
            ps.push(key, torch.zeros(2, dtype=torch.float64)).result(10)
        with pytest.raises(NonFiniteError, match="NaN or infinity"):
            ps.push(key, torch.tensor([1.0, math.nan])).result(10)
        out = torch.ones(2)
        ps.pull(key, out).result(10)
        assert out.tolist() == [0.0, 0.0]  # nothing was applied


def test_nonfinite_skip_on_the_client_and_refusal_on_the_server(open_server: ServerHandle) -> None:
    with RemoteParameterServer(
        open_server.address, worker_id=8, timeout=10, nonfinite="skip"
    ) as ps:
        ps.init("nf", torch.zeros(2))
        ps.push("nf", torch.tensor([math.inf, 1.0])).result(10)  # dropped, future done
        assert ps.skipped == 1
        # Straight to the server, past the client's check: refused there too.
        raw = ps._submit(Op.PUSH, "nf", "nf", 0, payload=torch.tensor([math.nan, 1.0]))
        with pytest.raises(NonFiniteError, match=open_server.address.replace(".", r"\.")):
            raw.result(10)
        out = torch.ones(2)
        ps.pull("nf", out).result(10)
        assert out.tolist() == [0.0, 0.0]


def test_push_and_pull_before_init_wait_for_it(open_server: ServerHandle) -> None:
    # The README's race: rank 1 pushes and pulls before rank 0 has initialised.
    with (
        RemoteParameterServer(open_server.address, worker_id=1, timeout=20) as rank1,
        RemoteParameterServer(open_server.address, worker_id=0, timeout=20) as rank0,
    ):
        pushed = rank1.push("late", torch.ones(2))
        out = torch.zeros(2)
        pulled = rank1.pull("late", out)
        time.sleep(0.3)  # let them reach the server before the init does
        assert not pulled.done()
        threading.Thread(target=rank0.init, args=("late", torch.full((2,), 5.0))).start()
        pushed.result(20)
        pulled.result(20)
        assert out.tolist() == [4.0, 4.0]  # init 5, then the push (SGD lr=1)
