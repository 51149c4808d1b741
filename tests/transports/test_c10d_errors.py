"""c10d's errors as gradhub's (gradhub.transports.c10d_errors), from real c10d errors."""

from __future__ import annotations

import gc
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from gradhub.errors import CollectiveTimeoutError, RendezvousError, WorkerFailedError
from gradhub.runtime import free_loopback_port
from gradhub.transports.c10d_errors import first_line, is_timeout, rendezvous_error, translate


def _store(port: int, host: bool) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1",
        port,
        None,
        is_master=host,
        wait_for_workers=False,
        timeout=timedelta(seconds=5),
    )


def test_a_wait_that_runs_out_is_a_timeout_naming_the_ranks_waited_on() -> None:
    store = _store(free_loopback_port(), host=True)
    with pytest.raises(RuntimeError) as info:  # c10d's DistStoreError
        store.wait(["never written"], timedelta(seconds=0.1))
    assert is_timeout(info.value)
    err = translate(info.value, what="[rank 0] exchange", timeout=0.1, ranks=[2, 1, 2])
    assert isinstance(err, CollectiveTimeoutError)
    assert list(err.missing_ranks) == [1, 2]
    assert str(err) == (
        "[rank 0] exchange timed out after 0.1s waiting for rank(s) 1, 2 "
        f"({first_line(info.value)})"
    )
    detailed = translate(info.value, what="x", timeout=0.1, ranks=[1], detail="its part")
    assert str(detailed).endswith("waiting for rank(s) 1 (its part)")


def test_a_store_whose_host_is_gone_is_a_lost_peer_with_c10d_first_line() -> None:
    port = free_loopback_port()
    host = _store(port, host=True)
    client = _store(port, host=False)
    client.set("before", "1")
    del host  # its server goes with it: the host process died
    gc.collect()
    with pytest.raises(RuntimeError) as info:
        for i in range(3):  # a send may still be taken before the reset is seen
            client.set(f"after/{i}", "1")
    assert not is_timeout(info.value), info.value
    err = translate(info.value, what="[rank 1] all_reduce", timeout=5.0, ranks=[0])
    assert isinstance(err, WorkerFailedError)
    assert str(err) == (
        f"[rank 1] all_reduce: rank(s) 0 died or left the job ({first_line(info.value)})\n"
        "- help: check the log of rank(s) 0; restart the job (it resumes from the last checkpoint)"
    )
    named = translate(
        info.value, what="[rank 1] put", timeout=5.0, lost="the store died", help="see rank 0"
    )
    assert (
        str(named) == f"[rank 1] put: the store died ({first_line(info.value)})\n- help: see rank 0"
    )


def test_joining_is_a_rendezvous_error_whatever_failed() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: nobody answers
        with pytest.raises(RuntimeError) as info:  # c10d's DistNetworkError
            dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=0.2))
    err = rendezvous_error(
        info.value, what="[rank 1] could not join the job", timeout=0.2, help="start rank 0"
    )
    assert isinstance(err, RendezvousError)  # a timeout or not, the job did not form
    assert str(err) == (
        f"[rank 1] could not join the job within 0.2s: {first_line(info.value)}\n"
        "- help: start rank 0"
    )


def test_the_first_line_drops_the_stack_and_names_the_class_of_an_empty_message() -> None:
    assert first_line(RuntimeError("Connection reset by peer\nException raised from ...")) == (
        "Connection reset by peer"
    )
    assert first_line(RuntimeError("  ")) == "RuntimeError"
    assert is_timeout(RuntimeError("Timed out waiting 3000ms for recv operation to complete"))
    assert not is_timeout(RuntimeError("Connection closed by peer [127.0.0.1]:4321"))
