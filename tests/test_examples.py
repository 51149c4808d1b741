"""examples/ddp_port.py and examples/charlm.py under every strategy with 2 ranks."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import gradhub
from gradhub.ps.config import ServerConfig
from gradhub.ps.launch import start_server
from harness import run_ranks

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STRATEGIES = ["allreduce", "sharded", "ps-async", "ps-sync", "ps-ssp"]


def _examples_job(rank: int, world: int, servers: dict[str, str]) -> dict[str, Any]:
    sys.path.insert(0, str(EXAMPLES))
    ddp_port, charlm = importlib.import_module("ddp_port"), importlib.import_module("charlm")
    out: dict[str, Any] = {}
    # One process group for every run; the examples' own init() adopts it.
    with gradhub.init(timeout=60):
        for strategy in STRATEGIES:
            extra = ["--servers", servers[strategy]] if strategy in servers else []
            port = ddp_port.main(
                ["--strategy", strategy, "--samples", "256", "--epochs", "2", *extra]
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


def test_examples_learn_under_every_strategy() -> None:
    with (
        start_server(ServerConfig(mode="async", workers=2)) as a,
        start_server(ServerConfig(mode="sync", workers=2)) as s,
        start_server(ServerConfig(mode="ssp", workers=2, max_staleness=2)) as p,
    ):
        servers = {"ps-async": a.address, "ps-sync": s.address, "ps-ssp": p.address}
        results = run_ranks(_examples_job, 2, servers, timeout=400)
    for strategy, (port_first, port_last, lm_first, lm_last) in results[0].value.items():
        assert port_last < 0.7 * port_first, (strategy, port_first, port_last)
        assert lm_last < 0.85 * lm_first, (strategy, lm_first, lm_last)
