"""Start a local job: parameter servers (optional), then torchrun's machinery.

:func:`launch` is what ``gradhub run`` and ``gradhub demo`` call. It does not
manage worker processes itself: it hands them to ``torch.distributed.run``
(static rendezvous on 127.0.0.1, no restarts), so a script that works here
works unchanged under ``torchrun --nnodes ...``.

With ``servers > 0`` it first starts that many parameter servers on loopback
(:func:`gradhub.ps.launch.start_server`), then publishes their addresses in
the c10d store that torchrun's agent hosts at ``MASTER_ADDR:MASTER_PORT``,
under :data:`gradhub.train.strategies.ps.ADDRESSES_KEY` (a JSON list). The
workers' parameter-server strategies read it there: no environment variables
of our own. The servers stop when the job ends.

Errors are raised before anything starts where they can be: a script that
does not exist, fewer than one process, a bad server configuration.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from gradhub.collective.group import free_loopback_port
from gradhub.ps.config import ServerConfig
from gradhub.train.strategies.ps import ADDRESSES_KEY

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LaunchConfig:
    """A local job: ``nproc`` worker processes running ``target``."""

    nproc: int
    """Worker processes (ranks) on this machine."""
    target: list[str]
    """The script and its arguments (or, with ``module``, a module name and its arguments)."""
    module: bool = False
    """Run ``target[0]`` as a module (``python -m``)."""
    servers: int = 0
    """Parameter servers to start before the workers (0: none)."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """Template of every server's configuration (mode, optimizer, lr, ...);
    ``bind`` and ``workers`` are set per job."""
    master_port: int | None = None
    """Port of the job's c10d store on 127.0.0.1 (default: a free one)."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"-n/--nproc must be >= 1, got {self.nproc}")
        if self.servers < 0:
            raise ValueError(f"--servers must be >= 0, got {self.servers}")
        if not self.target:
            raise ValueError("give the script to run (and its arguments)")
        if not self.module and not Path(self.target[0]).is_file():
            raise FileNotFoundError(
                f"script {self.target[0]!r} not found\n- help: give the path of a Python "
                "script, or use -m/--module for an importable module"
            )


def _server_config(template: ServerConfig, workers: int) -> ServerConfig:
    return dataclasses.replace(template, bind="tcp://127.0.0.1:*", workers=workers)


def _publish(port: int, addresses: list[str], timeout: float) -> None:
    """Put the server addresses into the agent's store once it is up."""
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout)
        )
        store.set(ADDRESSES_KEY, json.dumps(addresses))
    except (RuntimeError, dist.DistError) as exc:
        log.error("could not publish parameter-server addresses on port %d: %s", port, exc)


def torchrun_args(config: LaunchConfig, port: int) -> list[str]:
    """The ``torch.distributed.run`` command line for ``config``."""
    args = [
        "--nnodes=1",
        f"--nproc-per-node={config.nproc}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "--max-restarts=0",
        "--monitor-interval=0.5",
    ]
    if config.module:
        args.append("--module")
    return args + list(config.target)


def launch(config: LaunchConfig) -> int:
    """Run the job to the end; returns 0 on success, 1 if a worker failed."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from gradhub.ps.launch import start_server

    port = config.master_port or free_loopback_port()
    handles = []
    try:
        for _ in range(config.servers):
            handles.append(start_server(_server_config(config.server, config.nproc)))
        if handles:
            addresses = [h.address for h in handles]
            log.info("parameter servers (%s) at %s", config.server.mode, ", ".join(addresses))
            threading.Thread(
                target=_publish, args=(port, addresses, 60.0), name="gradhub-publish", daemon=True
            ).start()
        args = get_args_parser().parse_args(torchrun_args(config, port))
        try:
            run(args)
        except ChildFailedError as exc:
            ranks = ", ".join(
                f"rank {rank} (exit code {f.exitcode})" for rank, f in exc.failures.items()
            )
            log.error("job failed: %s", ranks or exc)
            return 1
        return 0
    finally:
        for h in handles:
            h.close()
