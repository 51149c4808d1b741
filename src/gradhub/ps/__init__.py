"""Parameter servers: the interface, the in-process store and the ZeroMQ client/server."""

from gradhub.ps.base import ParameterServer

__all__ = ["ParameterServer"]
