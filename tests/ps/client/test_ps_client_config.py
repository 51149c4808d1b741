"""RemoteParameterServer's settings: one typed ClientConfig, the keywords mapped onto it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gradhub import RemoteParameterServer, ServerConfig, start_server
from gradhub.ps import ClientConfig

ADDRESS = "tcp://127.0.0.1:1"


def test_keywords_and_config_are_one_configuration() -> None:
    with start_server(ServerConfig(lr=1.0), in_thread=True) as server:
        config = ClientConfig(addresses=server.address, worker_id=3, timeout=20, compress="BF16")
        with RemoteParameterServer(config=config) as ps:
            assert ps.config.addresses == [server.address] and ps.codec.name == "bf16"
            ps.init("w", torch.zeros(2))
            ps.push("w", torch.ones(2)).result(20)
            out = torch.empty(2)
            ps.pull("w", out).result(20)
            assert out.tolist() == [-1.0, -1.0]
        with RemoteParameterServer(
            server.address, worker_id=3, timeout=20, compress="bf16"
        ) as same:
            assert dataclasses.asdict(same.config) == dataclasses.asdict(config)
            same.pull("w", out).result(20)
            assert out.tolist() == [-1.0, -1.0]


def test_one_source_per_setting() -> None:
    config = ClientConfig(addresses=ADDRESS, worker_id=0)
    with pytest.raises(TypeError, match="not both"):
        RemoteParameterServer(ADDRESS, config=config)
    with pytest.raises(TypeError, match="not both"):
        RemoteParameterServer(config=config, timeout=3)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"worker_id": -1}, r"worker_id must be in \[0, 2\*\*32\)"),
        ({"worker_id": True}, "worker_id must be an int"),
        ({"nonfinite": "drop"}, "nonfinite must be 'error' or 'skip'"),
        ({"timeout": 0}, "timeout must be > 0 seconds"),
        ({"connect_timeout": -1}, "connect_timeout must be > 0 seconds"),
        ({"retry_interval": 0}, "retry_interval must be > 0 seconds"),
        ({"slice_bytes": 0}, "slice_bytes must be > 0 bytes"),
        ({"arena_min_bytes": -1}, "arena_min_bytes must be >= 0"),
        ({"addresses": []}, "at least one parameter-server address"),
        ({"addresses": "localhost:5555"}, "tcp://HOST:PORT"),
    ],
)
def test_each_setting_is_validated_in_the_config(options: dict[str, object], message: str) -> None:
    settings: dict[str, object] = {"addresses": ADDRESS, "worker_id": 0, **options}
    with pytest.raises((ValueError, TypeError), match=message):
        ClientConfig(**settings)  # type: ignore[arg-type]
    with pytest.raises((ValueError, TypeError), match=message):
        RemoteParameterServer(**settings)
