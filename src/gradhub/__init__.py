"""gradhub: distributed data-parallel training on PyTorch.

Public API only; everything else lives in subpackages.
"""

from gradhub import codecs, partition, trees
from gradhub._version import __version__
from gradhub.collective import AllReduceParameter, ShardedOptimizer
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
from gradhub.ps.config import ServerConfig
from gradhub.ps.launch import ServerHandle, start_server
from gradhub.ps.local import LocalParameterServer
from gradhub.ps.remote import RemoteParameterServer
from gradhub.train.runtime import Runtime, init
from gradhub.train.trainer import DataParallelTrainer, FitConfig, FitResult

__all__ = [
    "AllReduceParameter",
    "AuthenticationError",
    "ClosedError",
    "CollectiveTimeoutError",
    "DataParallelTrainer",
    "DistributedGradientsCoordinator",
    "DuplicateParameterError",
    "FitConfig",
    "FitResult",
    "GradhubError",
    "GradhubTimeoutError",
    "LocalParameterServer",
    "ModelUpdate",
    "NonFiniteError",
    "ParameterServer",
    "ProtocolError",
    "RemoteParameterServer",
    "Runtime",
    "ServerConfig",
    "ServerHandle",
    "ServerTimeoutError",
    "ShapeMismatchError",
    "ShardedOptimizer",
    "StateError",
    "UnknownParameterError",
    "WorkerFailedError",
    "WorkerUpdate",
    "__version__",
    "codecs",
    "init",
    "merge_worker_updates",
    "partition",
    "split_batch",
    "start_server",
    "trees",
]
