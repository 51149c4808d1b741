import importlib
import inspect
import pkgutil

import gradhub
import gradhub.collective
import gradhub.errors
import gradhub.ps

PUBLIC = {
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
}

COLLECTIVE = {
    "AllReduceParameter",
    "CollectiveFuture",
    "CollectiveGroup",
    "DEFAULT_TIMEOUT",
    "ShardedOptimizer",
    "all_gather",
    "all_reduce",
    "destroy_process_group",
    "free_loopback_port",
    "init_process_group_from_env",
    "local_group",
    "reduce_scatter",
}

PS = {
    "ClientConfig",
    "LocalParameterServer",
    "ParameterServer",
    "ParameterStore",
    "RemoteParameterServer",
    "ServerConfig",
    "ServerHandle",
    "start_server",
}


def test_all_names_exist_and_are_sorted() -> None:
    for module in (gradhub, gradhub.collective, gradhub.ps):
        for name in module.__all__:
            assert hasattr(module, name), name
    assert list(gradhub.__all__) == sorted(gradhub.__all__, key=str)


def test_public_names_are_exactly_these() -> None:
    # Adding or removing a public name is a decision: change this set with it.
    assert set(gradhub.__all__) == PUBLIC
    assert len(gradhub.__all__) == len(PUBLIC)  # no name listed twice
    assert set(gradhub.collective.__all__) == COLLECTIVE
    assert len(gradhub.collective.__all__) == len(COLLECTIVE)
    assert set(gradhub.ps.__all__) == PS
    assert len(gradhub.ps.__all__) == len(PS)


def test_every_error_class_lives_in_errors() -> None:
    defined_elsewhere = []
    for info in pkgutil.walk_packages(gradhub.__path__, "gradhub."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == info.name
                and info.name != "gradhub.errors"
            ):
                defined_elsewhere.append(f"{info.name}.{name}")
    assert defined_elsewhere == []
    # Timeouts are one family: every *TimeoutError derives from GradhubTimeoutError.
    for name, obj in vars(gradhub.errors).items():
        if inspect.isclass(obj) and name.endswith("TimeoutError"):
            assert issubclass(obj, gradhub.errors.GradhubTimeoutError), name
