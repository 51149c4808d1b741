"""gradhub: distributed data-parallel training on PyTorch.

Public API only; everything else lives in subpackages.
"""

from gradhub import backend as _backend
from gradhub import codecs, partition, trees
from gradhub._version import __version__
from gradhub.collective import AllReduceParameter, ShardedOptimizer
from gradhub.errors import (
    AuthenticationError,
    ClosedError,
    CollectiveTimeoutError,
    DtypeMismatchError,
    DuplicateParameterError,
    GradhubError,
    GradhubTimeoutError,
    MisuseError,
    NonFiniteError,
    OptimizerMismatchError,
    ProtocolError,
    ReplicasDivergedError,
    ServerTimeoutError,
    ServerUnavailableError,
    ShapeMismatchError,
    StateError,
    TooFewWorkersError,
    UnknownParameterError,
    WorkerFailedError,
)
from gradhub.inprocess import (
    DistributedGradientsCoordinator,
    ModelUpdate,
    WorkerUpdate,
    merge_worker_updates,
    split_batch,
)
from gradhub.ps.base import ParameterServer
from gradhub.ps.client.remote import RemoteParameterServer
from gradhub.ps.local import LocalParameterServer
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.launch import ServerHandle, start_server
from gradhub.runtime import Runtime, init
from gradhub.train.distributed_optimizer import DistributedOptimizer
from gradhub.train.fit_config import FitConfig, FitResult
from gradhub.train.grad_scaler import GradScaler
from gradhub.train.prepare import check_in_sync, clip_grad_norm_, prepare
from gradhub.train.sampler import GlobalBatchSampler
from gradhub.train.trainer import DataParallelTrainer
from gradhub.train.wrapped_model import PreparedModel

# ``dist.init_process_group("gradhub")`` works once gradhub is imported.
_backend.register()

__all__ = [
    "AllReduceParameter",
    "AuthenticationError",
    "ClosedError",
    "CollectiveTimeoutError",
    "DataParallelTrainer",
    "DistributedGradientsCoordinator",
    "DistributedOptimizer",
    "DtypeMismatchError",
    "DuplicateParameterError",
    "FitConfig",
    "FitResult",
    "GlobalBatchSampler",
    "GradScaler",
    "GradhubError",
    "GradhubTimeoutError",
    "LocalParameterServer",
    "MisuseError",
    "ModelUpdate",
    "NonFiniteError",
    "OptimizerMismatchError",
    "ParameterServer",
    "PreparedModel",
    "ProtocolError",
    "RemoteParameterServer",
    "ReplicasDivergedError",
    "Runtime",
    "ServerConfig",
    "ServerHandle",
    "ServerTimeoutError",
    "ServerUnavailableError",
    "ShapeMismatchError",
    "ShardedOptimizer",
    "StateError",
    "TooFewWorkersError",
    "UnknownParameterError",
    "WorkerFailedError",
    "WorkerUpdate",
    "__version__",
    "check_in_sync",
    "clip_grad_norm_",
    "codecs",
    "init",
    "merge_worker_updates",
    "partition",
    "prepare",
    "split_batch",
    "start_server",
    "trees",
]
