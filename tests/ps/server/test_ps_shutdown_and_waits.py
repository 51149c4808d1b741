"""A server obeys SHUTDOWN only from a worker that said hello to this incarnation,
and a wait that times out names the ids of the workers it waits for."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch
import zmq

from gradhub import GradhubTimeoutError, RemoteParameterServer, ServerConfig, start_server
from gradhub.ps.server.consistency import Consistency
from gradhub.ps.wire import protocol
from gradhub.ps.wire.protocol import Header, Op, Status


def _ask(sock: zmq.Socket[Any], header: Header, secret: bytes | None = None) -> Any:
    sock.send_multipart(protocol.encode(header, secret=secret))
    assert sock.poll(10_000), "the server did not answer"
    return protocol.decode(sock.recv_multipart(), secret=secret)


def test_a_stale_or_unknown_shutdown_is_refused_and_the_server_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    caplog.set_level(logging.WARNING, logger="gradhub.ps.server.server")
    with start_server(ServerConfig(lr=1.0), in_thread=True) as server:
        try:
            sock.connect(server.address)
            # A worker that never said hello, naming an incarnation of another start.
            stale = _ask(sock, Header(op=Op.SHUTDOWN, request_id=1, worker_id=9, incarnation=7))
            assert stale.header.status == Status.STALE_INCARNATION
            assert "shutdown refused: it names incarnation 7" in stale.text()
            # The right incarnation (read from that reply), still no hello.
            current = stale.header.incarnation
            unknown = _ask(
                sock, Header(op=Op.SHUTDOWN, request_id=2, worker_id=9, incarnation=current)
            )
            assert unknown.header.status == Status.REFUSED
            assert "worker 9 (session 0) has not said hello" in unknown.text()
            assert sum("shutdown refused" in r.getMessage() for r in caplog.records) == 2
            with RemoteParameterServer(server.address, worker_id=1, timeout=20) as ps:
                ps.init("w", torch.zeros(1))  # still serving
                out = torch.ones(1)
                ps.pull("w", out).result(20)
                assert out.item() == 0.0
                assert ps.stats()[0]["counters"]["refused_shutdowns"] == 2
                ps.shutdown_servers()  # said hello: obeyed
            deadline = time.monotonic() + 20
            while server.is_alive() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not server.is_alive()
        finally:
            sock.close()
            ctx.term()


def test_an_unsigned_shutdown_to_a_signed_server_changes_nothing() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    config = ServerConfig(lr=1.0, secret=b"s3cret")
    with start_server(config, in_thread=True) as server:
        try:
            sock.connect(server.address)
            sock.send_multipart(protocol.encode(Header(op=Op.SHUTDOWN, request_id=1)))
            with RemoteParameterServer(server.address, worker_id=1, secret="s3cret") as ps:
                ps.init("w", torch.zeros(1))
                assert ps.stats()[0]["counters"]["dropped_unauthenticated"] >= 1
            assert server.is_alive()
        finally:
            sock.close()
            ctx.term()


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_wait_that_times_out_names_the_ids_it_waits_for(mode: str) -> None:
    config = ServerConfig(lr=1.0, mode=mode, workers=3, heartbeat_timeout=60)
    with (
        start_server(config, in_thread=True) as server,
        RemoteParameterServer(server.address, worker_id=0, timeout=1.0) as a,
        RemoteParameterServer(server.address, worker_id=1, timeout=1.0) as b,
        RemoteParameterServer(server.address, worker_id=5, timeout=1.0) as quiet,
    ):
        a.init("w", torch.zeros(1))
        quiet.stats()  # heard from, never pushes
        a.push("w", torch.ones(1)).result(10)
        b.push("w", torch.ones(1)).result(10)
        with pytest.raises(GradhubTimeoutError) as err:
            a.pull("w", torch.zeros(1)).result(10)
    text = str(err.value)
    assert "1 worker that never pushed: worker 5 (heard from, never pushed)" in text
    assert "the server waits for 3 workers; pushed so far: workers 0, 1" in text


def test_workers_never_heard_from_are_a_count_not_an_id() -> None:
    # The server cannot know the ids of workers that never spoke: it counts
    # them, in words that cannot be read as an id.
    waits = Consistency("sync", workers=4)
    waits.seen(0, pushing=True)
    waits.seen(2)
    text = waits.waiting_for(0, "w")
    assert "3 workers that never pushed: worker 2 (heard from, never pushed) and " in text
    assert "2 workers never heard from (the server waits for 4 workers; " in text
    assert "pushed so far: worker 0)" in text
    alone = Consistency("ssp", workers=2)
    alone.seen(0, pushing=True)
    assert "1 worker that never pushed: 1 worker never heard from" in alone.waiting_for(0, "w")
