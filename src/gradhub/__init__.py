"""gradhub: distributed data-parallel training on PyTorch.

Public API only; everything else lives in subpackages.
"""

from gradhub import codecs, partition, trees
from gradhub._version import __version__
from gradhub.errors import (
    AuthenticationError,
    ClosedError,
    CollectiveTimeoutError,
    DuplicateParameterError,
    GradhubError,
    GradhubTimeoutError,
    NonFiniteError,
    ProtocolError,
    ServerTimeoutError,
    ShapeMismatchError,
    StateError,
    UnknownParameterError,
    WorkerFailedError,
)
from gradhub.ps.base import ParameterServer

__all__ = [
    "AuthenticationError",
    "ClosedError",
    "CollectiveTimeoutError",
    "DuplicateParameterError",
    "GradhubError",
    "GradhubTimeoutError",
    "NonFiniteError",
    "ParameterServer",
    "ProtocolError",
    "ServerTimeoutError",
    "ShapeMismatchError",
    "StateError",
    "UnknownParameterError",
    "WorkerFailedError",
    "__version__",
    "codecs",
    "partition",
    "trees",
]
