"""ZeroMQ's errors through the parameter server's one translation
(``gradhub.ps.wire.zmq_errors.translate``): a server that cannot bind and a
client that cannot connect raise gradhub's classes, which are also the built-in
classes a caller would catch."""

from __future__ import annotations

import errno

import pytest
import zmq

from gradhub import RemoteParameterServer, ServerConfig
from gradhub.errors import BindError, InvalidOptionError
from gradhub.ps.server.server import Server
from gradhub.ps.wire.zmq_errors import translate


def test_a_bind_and_a_connect_map_to_gradhub_errors() -> None:
    exc = zmq.ZMQError(errno.EADDRINUSE)
    bind = translate(exc, endpoint="tcp://127.0.0.1:5555", action="bind")
    assert isinstance(bind, BindError) and isinstance(bind, OSError)
    assert str(bind) == f"cannot bind parameter server to tcp://127.0.0.1:5555: {exc}"
    exc = zmq.ZMQError(errno.ENAMETOOLONG)
    connect = translate(exc, endpoint="ipc:///x", action="connect")
    assert isinstance(connect, InvalidOptionError) and isinstance(connect, ValueError)
    assert str(connect) == f"cannot connect to parameter server 'ipc:///x': {exc}"


def test_a_server_on_an_address_in_use_raises_bind_error() -> None:
    first = Server(ServerConfig())  # bound by its constructor; no loop needed
    try:
        with pytest.raises(BindError, match="cannot bind parameter server to tcp://"):
            Server(ServerConfig(bind=first.address))
    finally:
        first.close()


def test_a_client_whose_address_zeromq_refuses_raises_a_value_error() -> None:
    address = "ipc:///tmp/" + "x" * 200  # an accepted form, but longer than a socket path
    with pytest.raises(InvalidOptionError, match="cannot connect to parameter server"):
        RemoteParameterServer(address, worker_id=0)
