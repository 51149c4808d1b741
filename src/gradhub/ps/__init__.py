"""Parameter servers: the interface, the in-process store and the ZeroMQ client/server."""

from gradhub.ps.base import ParameterServer
from gradhub.ps.client_config import ClientConfig
from gradhub.ps.config import ServerConfig
from gradhub.ps.launch import ServerHandle, start_server
from gradhub.ps.local import LocalParameterServer
from gradhub.ps.remote import RemoteParameterServer
from gradhub.ps.store import ParameterStore

__all__ = [
    "ClientConfig",
    "LocalParameterServer",
    "ParameterServer",
    "ParameterStore",
    "RemoteParameterServer",
    "ServerConfig",
    "ServerHandle",
    "start_server",
]
