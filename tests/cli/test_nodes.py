"""Working out a node's place in a multi-node job, and ``gradhub run``'s multi-node errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradhub.cli.main import main
from gradhub.cli.nodes import interface_of, locate, split_endpoint


def test_split_endpoint() -> None:
    assert split_endpoint("10.0.0.1:29400") == ("10.0.0.1", 29400)
    assert split_endpoint("node0") == ("node0", 29400)
    assert split_endpoint("[::1]:1234") == ("::1", 1234)
    for bad in ("", ":29400", "host:port", "host:0", "host:70000"):
        with pytest.raises(ValueError, match="endpoint"):
            split_endpoint(bad)


def test_loopback_endpoint_is_hosted_by_node_zero() -> None:
    first, second = locate("127.0.0.1:29400", node_rank=0), locate("127.0.0.1", node_rank=1)
    assert first.local_addr == second.local_addr == "127.0.0.1"
    assert first.is_host and not second.is_host
    assert first.ifname == interface_of("127.0.0.1") == "lo"


def test_run_refuses_bad_multinode_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(0)\n")
    assert main(["run", "-n", "1", "--nnodes", "2", str(script)]) == 2
    assert "needs --rdzv-endpoint" in capsys.readouterr().err
    assert main(["run", "-n", "1", "--nnodes", "2", "--node-rank", "2",
                 "--rdzv-endpoint", "127.0.0.1", str(script)]) == 2  # fmt: skip
    assert "--node-rank must be in [0, 2)" in capsys.readouterr().err
    assert main(["run", "-n", "1", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1",
                 "--servers", "1", str(script)]) == 2  # fmt: skip
    assert "--ps-secret-file" in capsys.readouterr().err
