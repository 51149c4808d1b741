"""The command line around ``strategy="diloco"`` with parameter servers:
``gradhub serve --nesterov`` (the servers fixed to diloco's outer optimizer),
and ``gradhub run --servers N`` without the mode diloco needs (the job stops
with one line naming ``--ps-mode``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gradhub
from gradhub.cli.main import build_parser
from gradhub.cli.serve import server_config
from gradhub.errors import InvalidOptionError
from gradhub.optim import OptimizerSpec
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.launch import start_server

NESTEROV = OptimizerSpec.of("sgd", lr=0.7, momentum=0.9, nesterov=True)
"""diloco's default outer optimizer, as the servers hold it."""


def _serve(*argv: str) -> ServerConfig:
    return server_config(build_parser().parse_args(["serve", *argv]))


def test_serve_nesterov_fixes_diloco_s_outer_optimizer() -> None:
    config = _serve("--optimizer", "sgd", "--lr", "0.7", "--momentum", "0.9", "--nesterov")
    assert config.optimizer == NESTEROV
    assert (config.lr, config.momentum) == (None, None)
    assert _serve("--lr", "0.7", "--momentum", "0.9", "--nesterov").optimizer == NESTEROV
    plain = _serve("--lr", "0.7", "--momentum", "0.9").optimizer
    assert isinstance(plain, OptimizerSpec) and plain != NESTEROV


@pytest.mark.parametrize(
    "argv",
    [("--nesterov",), ("--lr", "0.7", "--nesterov"), ("--optimizer", "adam", "--nesterov")],
)
def test_serve_nesterov_without_sgd_momentum_is_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(InvalidOptionError, match="--nesterov is SGD's Nesterov momentum"):
        _serve(*argv)


def test_a_diloco_worker_takes_servers_fixed_by_serve_nesterov() -> None:
    """A server of ``gradhub serve --mode sync --workers 1 --optimizer sgd --lr 0.7
    --momentum 0.9 --nesterov`` (in a thread) accepts diloco's default outer
    optimizer: its keys' specs match (a server without --nesterov refuses it:
    tests/train/test_diloco_servers.py)."""
    argv = ("--bind", "tcp://127.0.0.1:0", "--mode", "sync", "--workers", "1")
    config = _serve(*argv, "--optimizer", "sgd", "--lr", "0.7", "--momentum", "0.9", "--nesterov")
    with (
        start_server(config, in_thread=True, start_timeout=120) as server,
        gradhub.init(timeout=10) as runtime,
    ):
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        prepared, _ = gradhub.prepare(
            model, opt, strategy="diloco", runtime=runtime, servers=[server.address]
        )
        prepared.close()


SCRIPT = """
import torch, gradhub
with gradhub.init(timeout=30) as runtime:
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gradhub.prepare(model, opt, strategy="diloco", runtime=runtime, servers=True)
"""


@pytest.mark.slow
def test_gradhub_run_servers_in_ps_async_mode_name_the_flag_diloco_needs(tmp_path: Path) -> None:
    """``gradhub run --servers 1`` starts servers in mode async (the ps-async
    default; the launcher does not know the script's strategy): a diloco worker
    stops at ``prepare`` with one line saying which mode and which flag."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "gradhub.cli.main", "run", "-n", "1", "--servers", "1"]
    done = subprocess.run([*cmd, str(script)], capture_output=True, text=True, timeout=300)
    log = done.stdout + done.stderr
    assert done.returncode != 0, log
    line = "strategy 'diloco' needs servers in mode 'sync', but they run in mode(s) async"
    assert line in log, log
    assert "(gradhub run: --ps-mode sync)" in log, log
