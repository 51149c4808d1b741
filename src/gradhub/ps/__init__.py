"""Parameter servers: the interface, the in-process store and the ZeroMQ client/server."""

from gradhub.ps.base import ParameterServer
from gradhub.ps.local import LocalParameterServer
from gradhub.ps.store import ParameterStore

__all__ = ["LocalParameterServer", "ParameterServer", "ParameterStore"]
