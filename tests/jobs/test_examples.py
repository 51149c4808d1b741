"""examples/ddp_port.py and examples/charlm.py under every strategy with 2 ranks."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch

import gradhub
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.launch import start_server
from harness import run_ranks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STRATEGIES = ["allreduce", "sharded", "ps-async", "ps-sync", "ps-ssp"]


def _examples_job(
    rank: int, world: int, servers: dict[str, str], checkpoint: str
) -> dict[str, Any]:
    sys.path.insert(0, str(EXAMPLES))
    ddp_port, charlm = importlib.import_module("ddp_port"), importlib.import_module("charlm")
    out: dict[str, Any] = {}
    # One process group for every run; the examples' own init() adopts it.
    with gradhub.init(timeout=60):
        for strategy in STRATEGIES:
            extra = ["--servers", servers[strategy]] if strategy in servers else []
            # sharded: the optimizer state is assembled from the ranks' slices.
            save = ["--checkpoint", checkpoint] if strategy == "sharded" else []
            port = ddp_port.main(
                ["--strategy", strategy, "--samples", "256", "--epochs", "2", *extra, *save]
            )
            lm = charlm.main(
                [
                    "--strategy",
                    strategy,
                    "--sentences",
                    "300",
                    "--length",
                    "32",
                    "--width",
                    "64",
                    "--layers",
                    "2",
                    "--epochs",
                    "2",
                    "--batch-size",
                    "16",
                    *extra,
                ]
            )
            out[strategy] = (port["first"], port["last"], lm["first"], lm["last"])
    return out


def test_examples_learn_under_every_strategy(tmp_path: Path) -> None:
    checkpoint = tmp_path / "ddp_port" / "ckpt.pt"
    with (
        start_server(ServerConfig(mode="async", workers=2)) as a,
        start_server(ServerConfig(mode="sync", workers=2)) as s,
        start_server(ServerConfig(mode="ssp", workers=2, max_staleness=2)) as p,
    ):
        servers = {"ps-async": a.address, "ps-sync": s.address, "ps-ssp": p.address}
        results = run_ranks(_examples_job, 2, servers, str(checkpoint), timeout=400)
    for strategy, (port_first, port_last, lm_first, lm_last) in results[0].value.items():
        assert port_last < 0.7 * port_first, (strategy, port_first, port_last)
        assert lm_last < 0.85 * lm_first, (strategy, lm_first, lm_last)
    _check_ddp_port_checkpoint(checkpoint)


def _check_ddp_port_checkpoint(path: Path) -> None:
    """The sharded run's rank-0 checkpoint loads into a plain model and optimizer."""
    saved = torch.load(path, weights_only=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    assert list(saved["model"]) == list(model.state_dict())  # no "module." prefix
    model.load_state_dict(saved["model"])  # strict
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.load_state_dict(saved["optimizer"])
    # The full state, not a rank's slice: a momentum buffer of each parameter's
    # shape, moved by the job's steps.
    for p in model.parameters():
        buffer = optimizer.state[p]["momentum_buffer"]
        assert buffer.shape == p.shape and bool(buffer.abs().sum() > 0)
    # ... and a plain step runs on it.
    x, y = torch.randn(4, 16), torch.randint(0, 3, (4,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
