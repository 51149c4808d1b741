"""Tensors the user allocates in the client's arena (``RemoteParameterServer.empty_like``):
the copying path's bits with no copy in the client, exactly once through retries and
a server restart, no write into the user's memory for a request given up, typed
errors for overlapping requests, and the memory's lifetime (the tensor's own)."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gradhub import (
    ClosedError,
    DtypeMismatchError,
    NonFiniteError,
    RemoteParameterServer,
    ServerConfig,
    ServerTimeoutError,
    StateError,
    start_server,
)
from gradhub.ps.server.launch import ServerHandle
from gradhub.ps.wire import arena
from harness import free_port, wait_until

pytestmark = pytest.mark.skipif(not arena.enabled(True), reason="needs memfd and send_fds")

SECRET = "shared secret"
N = 1 << 16  # 256 KB of float32: through the arena, sliced over two servers below


def _mapped(pid: int | None) -> int:
    """User-tensor segments mapped in process ``pid``."""
    return Path(f"/proc/{pid}/maps").read_text().count("memfd:gradhub-ps-tensor")


def _private_slots(ps: RemoteParameterServer) -> int:
    """Private segments the client made for copies (a shared tensor needs none)."""
    return sum(len(link.arena._slots) for link in ps._channel._servers if link.arena is not None)


@contextlib.contextmanager
def _stopped(server: ServerHandle) -> Iterator[None]:
    """The server process frozen (SIGSTOP) inside the block, thawed after it."""
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def test_shared_tensors_give_the_copying_paths_bits_without_a_client_copy() -> None:
    """Two signed servers, a key sliced over both: the same Adam steps through
    tensors of ``empty_like`` (read and written where they lie) and through ordinary
    ones (copied) leave the same bits on the servers and in the pulled tensors."""
    config = ServerConfig(optimizer="adam", lr=0.01, secret=SECRET)
    with (
        start_server(config, in_thread=True) as a,
        start_server(config, in_thread=True) as b,
        RemoteParameterServer(
            [a.address, b.address], worker_id=1, secret=SECRET, timeout=30, slice_bytes=64 << 10
        ) as ps,
    ):
        gen = torch.Generator().manual_seed(0)
        init, grads = torch.randn(N, generator=gen), torch.randn(3, N, generator=gen)
        value = ps.shared_like(init)
        grad = ps.empty_like(init)
        out = ps.empty_like(init)
        assert ps.in_arena(grad) and ps.in_arena(out[N // 2 :])
        assert not ps.in_arena(init) and not ps.in_arena(grad[::2])
        pointers = (grad.data_ptr(), out.data_ptr())
        ps.init("shared", value)
        for g in grads:
            grad.copy_(g)
            ps.push("shared", grad).result(30)
        ps.pull("shared", out).result(30)
        assert _private_slots(ps) == 0  # nothing was copied into a private segment
        assert (grad.data_ptr(), out.data_ptr()) == pointers  # nor reallocated
        assert torch.equal(grad, grads[-1])  # the push left the gradient as it was

        ps.init("plain", init.clone())
        for g in grads:
            ps.push("plain", g.clone()).result(30)
        plain = torch.empty(N)
        ps.pull("plain", plain).result(30)
        assert _private_slots(ps) > 0  # ordinary tensors still take the copying path

        # the same float operations on the same bytes, whichever way they travelled
        assert torch.equal(out, plain)
        half = torch.empty(N)
        ps.pull("shared", half).result(30)  # an ordinary tensor pulled from it
        assert torch.equal(half, plain)
        counters = [s["counters"] for s in ps.stats()]
    assert sum(c["push_applied"] for c in counters) == 2 * 3 * 2  # 2 keys, 3 pushes, 2 slices
    assert sum(c["dropped_unauthenticated"] for c in counters) == 0
    assert all(c["arena_replies"] >= 2 and c["arena_shared_replies"] == 1 for c in counters)


@pytest.mark.slow
def test_retried_requests_of_shared_tensors_apply_once_and_never_write_late() -> None:
    """The server frozen while a push and a pull are retried: the push is applied once
    (its retries are duplicates), the pull is answered into the tensor by its first
    send only: a retry, answered later through a private segment, does not write
    into the tensor the user has moved on with."""
    with (
        start_server(ServerConfig(optimizer="sgd", lr=1.0)) as server,
        RemoteParameterServer(
            server.address, worker_id=1, timeout=30, retry_interval=0.1, heartbeat_interval=0.1
        ) as ps,
    ):
        ps.init("w", torch.zeros(N))
        grad = ps.shared_like(torch.ones(N))
        with _stopped(server):
            pushed = ps.push("w", grad)
            time.sleep(0.6)  # several retries queue up behind the first send
        pushed.result(30)
        out = ps.empty_like(grad)
        with _stopped(server):
            pulled = ps.pull("w", out)
            time.sleep(0.6)
        pulled.result(30)
        assert torch.equal(out, torch.full((N,), -1.0))
        out.fill_(7.0)  # the user moves on with the tensor
        ps.push("w", grad).result(30)
        later = torch.empty(N)
        ps.pull("w", later).result(30)  # after every retry of the first pull (one lane)
        assert torch.equal(later, torch.full((N,), -2.0))
        assert torch.equal(out, torch.full((N,), 7.0))  # no retry wrote into it
        counters = ps.stats()[0]["counters"]
    assert counters["push_applied"] == 2 and counters["push_duplicate"] >= 1
    assert counters["pull"] >= 3  # the first pull's retries were answered too, but
    assert counters["arena_shared_replies"] == 1  # only its first send into the tensor


@pytest.mark.slow
def test_a_shared_pull_given_up_is_cancelled_and_leaves_the_tensor_untouched() -> None:
    """A pull into a shared tensor past its deadline while the server is frozen: the
    client cancels it and fails it only once the thawed server confirmed; the
    server then answers it without writing into the tensor."""
    with start_server(ServerConfig(optimizer="sgd", lr=1.0)) as server:
        with RemoteParameterServer(server.address, worker_id=2, timeout=30) as driver:
            driver.init("w", torch.ones(N))  # the server's first request may take long
        with RemoteParameterServer(
            server.address, worker_id=1, timeout=2.0, heartbeat_interval=0.2
        ) as ps:
            out = ps.shared_like(torch.full((N,), 5.0))
            ps.pull("w", torch.empty(N)).result(30)  # connected, arena set up
            with _stopped(server):
                pulled = ps.pull("w", out)
                time.sleep(2.5)  # past the deadline: the cancel waits for the server
                assert not pulled.done()
            with pytest.raises(ServerTimeoutError) as caught:
                pulled.result(30)
            assert "may still change" not in str(caught.value)  # the server confirmed
            later = torch.empty(N)
            ps.pull("w", later).result(30)  # the cancelled pull was answered before it
            assert torch.equal(later, torch.ones(N))
            assert torch.equal(out, torch.full((N,), 5.0))
            ps.pull("w", out).result(30)  # the tensor is free again
            assert torch.equal(out, torch.ones(N))


@pytest.mark.slow
def test_shared_tensors_through_a_server_restart_stay_exactly_once(tmp_path: Path) -> None:
    """Pushes of a shared gradient acknowledged but not on disk when the server is
    killed are replayed to the restarted server (from the copies the client kept:
    the user may have changed the tensor since), each once; the tensors go on
    working with the new server process."""
    config = ServerConfig(
        bind=f"tcp://127.0.0.1:{free_port()}",
        optimizer="sgd",
        lr=1.0,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=3600.0,
    )
    fast = {"timeout": 30.0, "heartbeat_interval": 0.1, "retry_interval": 0.5}
    server = start_server(config)
    try:
        with RemoteParameterServer(server.address, worker_id=1, **fast) as ps:  # type: ignore[arg-type]
            ps.init("w", torch.zeros(N))
            ps.flush()
            grad = ps.empty_like(torch.empty(N))
            for step in (1.0, 2.0, 3.0):
                grad.fill_(step)
                ps.push("w", grad).result(30)
            grad.fill_(100.0)  # changed after the acknowledgements: not what is replayed
            server.kill()
            server = start_server(config)
            out = ps.empty_like(grad)
            ps.pull("w", out).result(30)
            assert torch.equal(out, torch.full((N,), -6.0))
            ps.push("w", grad).result(30)
            ps.pull("w", out).result(30)
            assert torch.equal(out, torch.full((N,), -106.0))
            counters = ps.stats()[0]["counters"]
            assert counters["push_applied"] == 4  # 3 replayed, 1 new: each once
            assert counters["arena_payloads"] >= 4 and counters["arena_replies"] == 2
    finally:
        server.close()


def test_overlapping_requests_and_mismatched_pulls_are_refused_at_the_call() -> None:
    with (
        start_server(ServerConfig(optimizer="sgd", lr=1.0), in_thread=True) as server,
        RemoteParameterServer(server.address, worker_id=1, timeout=20) as ps,
    ):
        ps.init("w", torch.zeros(N))
        t = ps.shared_like(torch.full((N,), 3.0))
        waiting = ps.pull("later", t)  # held by the server until "later" is initialised
        with pytest.raises(StateError, match="pull writes into"):
            ps.push("w", t[:100])
        with pytest.raises(StateError, match="pull writes into"):
            ps.pull("w", t[N - 10 :])
        ps.pull("w", torch.empty(N)).result(20)  # other tensors are not held up
        ps.init("later", torch.full((N,), 4.0))
        waiting.result(20)
        assert torch.equal(t, torch.full((N,), 4.0))

        g = ps.shared_like(torch.ones(N))
        pushing = ps.push("unborn", g)  # held until "unborn" is initialised
        second = ps.push("w", g)  # reading it twice at once is fine
        with pytest.raises(StateError, match="push reads"):
            ps.pull("w", g)
        second.result(20)
        ps.init("unborn", torch.zeros(N))
        pushing.result(20)
        ps.pull("w", g).result(20)
        assert torch.equal(g, torch.full((N,), -1.0))

        # A pull whose value is not of the tensor's dtype raises without writing into it
        # (the same bytes: only the dtype the request names stops the server).
        ints = ps.empty_like(torch.empty(N, dtype=torch.int32))
        ints.fill_(9)
        with pytest.raises(DtypeMismatchError):
            ps.pull("w", ints).result(20)
        assert torch.equal(ints, torch.full((N,), 9, dtype=torch.int32))

        # NaN in a shared gradient: refused by the server (the client does not read
        # it a second time), so through the future; nothing applied.
        g[-1] = float("nan")
        with pytest.raises(NonFiniteError):
            ps.push("w", g).result(20)
        with RemoteParameterServer(server.address, worker_id=2, nonfinite="skip") as skipping:
            shared_nan = skipping.shared_like(g)
            assert skipping.push("w", shared_nan).result(20) is None and skipping.skipped == 1
        ps.pull("w", t).result(20)
        assert torch.equal(t, torch.full((N,), -1.0))
    with pytest.raises(ClosedError):
        ps.empty_like(t)


@pytest.mark.slow
def test_a_shared_tensors_memory_lives_as_long_as_the_tensor() -> None:
    """A freed tensor's segment is unmapped by the server (told with the next request);
    closing the client leaves a live tensor valid, and the server unmaps it then."""
    with start_server(ServerConfig(optimizer="sgd", lr=1.0)) as server:
        ps = RemoteParameterServer(server.address, worker_id=1, timeout=20)
        ps.init("w", torch.zeros(N))
        kept, freed = ps.empty_like(torch.empty(N)), ps.empty_like(torch.empty(N))
        view = freed[10:20]  # a view keeps the memory alive too
        ps.pull("w", kept).result(20)
        ps.pull("w", freed).result(20)
        assert _mapped(server.pid) == 2
        del freed
        gc.collect()
        ps.pull("w", kept).result(20)
        assert _mapped(server.pid) == 2 and torch.equal(view, torch.zeros(10))
        del view
        gc.collect()
        ps.pull("w", kept).result(20)  # carries the word that the segment is gone
        assert wait_until(lambda: _mapped(server.pid) == 1, 10)
        ps.push("w", torch.ones(N)).result(20)
        ps.pull("w", kept).result(20)
        ps.close()
        assert wait_until(lambda: _mapped(server.pid) == 0, 10)
        assert torch.equal(kept, torch.full((N,), -1.0))  # still this process's memory
        kept.add_(1.0)
        assert _mapped(os.getpid()) == 1
        with pytest.raises(ClosedError):
            ps.empty_like(kept)
    del kept
    gc.collect()
    assert _mapped(os.getpid()) == 0
