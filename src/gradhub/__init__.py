"""gradhub: distributed data-parallel training on PyTorch.

Public API only; everything else lives in subpackages.
"""

from gradhub import codecs, partition, trees
from gradhub._version import __version__
from gradhub.coordinator import DistributedGradientsCoordinator
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
from gradhub.merge import ModelUpdate, WorkerUpdate, merge_worker_updates, split_batch
from gradhub.ps.base import ParameterServer
from gradhub.ps.local import LocalParameterServer
from gradhub.train.trainer import DataParallelTrainer

__all__ = [
    "AuthenticationError",
    "ClosedError",
    "CollectiveTimeoutError",
    "DataParallelTrainer",
    "DistributedGradientsCoordinator",
    "DuplicateParameterError",
    "GradhubError",
    "GradhubTimeoutError",
    "LocalParameterServer",
    "ModelUpdate",
    "NonFiniteError",
    "ParameterServer",
    "ProtocolError",
    "ServerTimeoutError",
    "ShapeMismatchError",
    "StateError",
    "UnknownParameterError",
    "WorkerFailedError",
    "WorkerUpdate",
    "__version__",
    "codecs",
    "merge_worker_updates",
    "partition",
    "split_batch",
    "trees",
]
