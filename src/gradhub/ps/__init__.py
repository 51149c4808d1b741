"""Parameter servers: the interface, the in-process server and the ZeroMQ client/server.

- ``base.py``: the :class:`ParameterServer` interface; ``local.py``: the
  in-process :class:`LocalParameterServer`.
- ``client/``: :class:`RemoteParameterServer` and its I/O; ``server/``: the
  server process (``start_server``, ``gradhub serve``); ``wire/``: what both
  share (the protocol, frames on sockets, reply statuses, the arena's messages).
  The client and the server never import each other.
- Shared by both: ``lanes.py`` (priority lanes), ``secret.py`` (the shared secret).
"""

from gradhub.ps.base import ParameterServer
from gradhub.ps.client.config import ClientConfig
from gradhub.ps.client.remote import RemoteParameterServer
from gradhub.ps.local import LocalParameterServer
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.launch import ServerHandle, start_server
from gradhub.ps.server.store import ParameterStore

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
