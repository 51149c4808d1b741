"""Start a local job: parameter servers (optional), then torchrun's machinery.

:func:`launch` is what ``gradhub run`` and ``gradhub demo`` call. It does not
manage worker processes itself: it hands them to ``torch.distributed.run``
(static rendezvous on 127.0.0.1), so a script that works here works
unchanged under ``torchrun --nnodes ...``.

Restarts (``max_restarts=N``, ``gradhub run --max-restarts N``) are
torchrun's elastic agent's: when a worker fails, the agent stops the others
and starts every worker again, up to N times; the job succeeds if an attempt
does. A restarted worker knows it is one from the agent's standard
environment (``TORCHELASTIC_RESTART_COUNT``, :attr:`gradhub.Runtime.restart`);
``fit`` then resumes from the last checkpoint every rank has (see
:mod:`gradhub.train.fit`). The parameter servers are this process's, not the
agent's: they keep running across restarts, and the addresses published in
the agent's store (which outlives the workers) stay valid.

With ``servers > 0`` it first starts that many parameter servers on loopback
(:func:`gradhub.ps.server.launch.start_server`), then publishes their addresses in
the c10d store that torchrun's agent hosts at ``MASTER_ADDR:MASTER_PORT``,
under :data:`gradhub.ps.client.addresses.ADDRESSES_KEY` (a JSON list). The
workers' parameter-server strategies read it there: no environment variables
of our own. The servers stop when the job ends.

Errors are raised before anything starts where they can be: a script that
does not exist, fewer than one process, a bad server configuration.

Across nodes (``nnodes > 1``), every node runs the same command with
torchrun's multi-node options (``nnodes``, ``node_rank``, ``rdzv_backend``,
``rdzv_endpoint``, ``rdzv_id``). :func:`gradhub.cli.nodes.locate` works
out what torchrun would otherwise need spelled out: this node's address
(``--local-addr``), whether it hosts the rendezvous store
(``--rdzv-conf is_host=1|0``) and ``GLOO_SOCKET_IFNAME`` (set only if the
user has not). With ``servers > 0``, node rank 0 starts the servers, bound
to its own address (so a shared secret is required), and publishes their
addresses in the workers' store; the other nodes start none. Under the
``c10d`` backend that store is the one torchrun's agent on the rendezvous's
rank-0 node creates after the rendezvous (not necessarily node rank 0); its
address is read from the rendezvous store, where torchrun puts it under
``torch.rendezvous.<run id>.<round>/MASTER_ADDR`` and ``.../MASTER_PORT``
(round 0: torchrun keeps that store across restarts while the node that hosts
it stays in the job). Under ``static`` the store is the endpoint itself.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from gradhub.cli.nodes import NodePlace, locate
from gradhub.errors import InvalidOptionError
from gradhub.ps.client.addresses import ADDRESSES_KEY
from gradhub.ps.server.config import ServerConfig
from gradhub.runtime import free_loopback_port

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
    """Port of the job's c10d store on 127.0.0.1 (default: a free one); one node only."""
    nnodes: int = 1
    """Nodes (machines) in the job; each runs ``nproc`` workers."""
    node_rank: int = 0
    """This node's rank in ``[0, nnodes)``: node 0 starts the parameter servers
    (and, under the ``static`` backend, hosts the store)."""
    rdzv_backend: str = "c10d"
    """torchrun's rendezvous backend across nodes: ``"c10d"`` or ``"static"``."""
    rdzv_endpoint: str | None = None
    """``HOST[:PORT]`` of the rendezvous (required with ``nnodes > 1``); the node
    whose address it is hosts the store."""
    rdzv_id: str = "none"
    """Job id shared by the nodes of one job (c10d)."""
    local_addr: str | None = None
    """This node's address as other nodes reach it (default: worked out from the endpoint)."""
    max_restarts: int = 0
    """Times torchrun's agent restarts every worker after one fails (0: a failure ends the
    job); with ``survive``: dead workers replaced by new ones, in all."""
    survive: bool = False
    """A worker's death ends only that worker; the others go on over the survivors
    (:mod:`gradhub.cli.supervisor`)."""
    min_workers: int = 1
    """With ``survive``: the job stops when fewer workers are left."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise InvalidOptionError(f"-n/--nproc must be >= 1, got {self.nproc}")
        if self.nnodes < 1:
            raise InvalidOptionError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise InvalidOptionError(
                f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}"
            )
        if self.rdzv_backend not in ("c10d", "static"):
            raise InvalidOptionError(
                f"--rdzv-backend must be 'c10d' or 'static', got {self.rdzv_backend!r}"
            )
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise InvalidOptionError(
                "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)"
            )
        if self.nnodes > 1 and self.master_port is not None:
            raise InvalidOptionError(
                "--master-port is for one node; across nodes give --rdzv-endpoint"
            )
        if self.nnodes > 1 and self.servers and self.server.secret is None:
            raise InvalidOptionError(
                "parameter servers of a multi-node job listen on this node's network address; "
                "give them a shared secret (--ps-secret-file), and the workers the same one"
            )
        if self.max_restarts < 0:
            raise InvalidOptionError(
                f"--max-restarts must be >= 0, got {self.max_restarts}\n- help: 0 ends the "
                "job at the first failed worker; N > 0 restarts the workers up to N times"
            )
        if self.survive:
            self._check_survive()
        elif self.min_workers != 1:
            raise InvalidOptionError("--min-workers is for surviving jobs; add --survive")
        if self.servers < 0:
            raise InvalidOptionError(f"--servers must be >= 0, got {self.servers}")
        if not self.target:
            raise InvalidOptionError("give the script to run (and its arguments)")
        if not self.module and not Path(self.target[0]).is_file():
            raise FileNotFoundError(
                f"script {self.target[0]!r} not found\n- help: give the path of a Python "
                "script, or use -m/--module for an importable module"
            )

    def _check_survive(self) -> None:
        workers = self.nproc * self.nnodes
        if not 1 <= self.min_workers <= workers:
            raise InvalidOptionError(
                f"--min-workers must be in [1, {workers}] (the workers started), "
                f"got {self.min_workers}"
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


def _read_store_address(place: NodePlace, config: LaunchConfig, timeout: float) -> tuple[str, int]:
    """Where the workers' store is: the endpoint (static) or what torchrun put in the rendezvous."""
    if config.rdzv_backend == "static":
        return place.endpoint_addr, place.endpoint_port
    rdzv = dist.TCPStore(
        place.endpoint_addr,
        place.endpoint_port,
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )
    prefix = f"torch.rendezvous.{config.rdzv_id}.0"
    keys = [f"{prefix}/MASTER_ADDR", f"{prefix}/MASTER_PORT"]
    rdzv.wait(keys, timedelta(seconds=timeout))
    return rdzv.get(keys[0]).decode(), int(rdzv.get(keys[1]).decode())


def _publish_across_nodes(
    place: NodePlace, config: LaunchConfig, addresses: list[str], timeout: float
) -> None:
    """Node 0: put the server addresses into the workers' store once the rendezvous is done."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            host, port = _read_store_address(place, config, timeout)
            break
        except (RuntimeError, dist.DistError) as exc:  # the store host is not up yet
            if time.monotonic() >= deadline:
                log.error(
                    "could not find the job's store through the rendezvous at %s:%d: %s",
                    place.endpoint_addr,
                    place.endpoint_port,
                    exc,
                )
                return
            time.sleep(0.5)
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))
        store.set(ADDRESSES_KEY, json.dumps(addresses))
    except (RuntimeError, dist.DistError) as exc:
        log.error("could not publish parameter-server addresses at %s:%d: %s", host, port, exc)


def torchrun_args(config: LaunchConfig, port: int, place: NodePlace | None = None) -> list[str]:
    """The ``torch.distributed.run`` command line for ``config`` (``place``: across nodes)."""
    if place is None:
        args = [
            "--nnodes=1",
            f"--nproc-per-node={config.nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
        ]
    else:
        args = [
            f"--nnodes={config.nnodes}",
            f"--nproc-per-node={config.nproc}",
            f"--node-rank={config.node_rank}",
            f"--rdzv-backend={config.rdzv_backend}",
            f"--rdzv-endpoint={place.endpoint_addr}:{place.endpoint_port}",
            f"--rdzv-id={config.rdzv_id}",
            f"--local-addr={config.local_addr or place.local_addr}",
        ]
        if config.rdzv_backend == "c10d":
            args.append(f"--rdzv-conf=is_host={int(place.is_host)}")
        else:
            args += [f"--master-addr={place.endpoint_addr}", f"--master-port={place.endpoint_port}"]
    args += [f"--max-restarts={config.max_restarts}", "--monitor-interval=0.5"]
    if config.module:
        args.append("--module")
    return args + list(config.target)


def launch(config: LaunchConfig) -> int:
    """Run the job to the end; returns 0 on success (after restarts, if any), 1 if a
    worker failed and no restart was left."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from gradhub.ps.server.launch import start_server

    place = None
    if config.nnodes > 1:
        assert config.rdzv_endpoint is not None  # checked by LaunchConfig
        place = locate(config.rdzv_endpoint, node_rank=config.node_rank)
        if place.ifname is not None and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = place.ifname  # the workers inherit it
        log.info(
            "node %d of %d: address %s (%s), %s the rendezvous store at %s:%d",
            config.node_rank,
            config.nnodes,
            config.local_addr or place.local_addr,
            place.ifname,
            "hosting" if place.is_host else "joining",
            place.endpoint_addr,
            place.endpoint_port,
        )
    port = config.master_port or free_loopback_port()
    servers = config.servers if config.node_rank == 0 else 0
    workers = config.nproc * config.nnodes
    handles = []
    try:
        for _ in range(servers):
            server = _server_config(config.server, workers)
            if place is not None:
                server = dataclasses.replace(
                    server, bind=f"tcp://{config.local_addr or place.local_addr}:*"
                )
            handles.append(start_server(server))
        if handles:
            addresses = [h.address for h in handles]
            log.info("parameter servers (%s) at %s", config.server.mode, ", ".join(addresses))
            if place is None:
                publisher = threading.Thread(target=_publish, args=(port, addresses, 60.0))
            else:
                publisher = threading.Thread(
                    target=_publish_across_nodes, args=(place, config, addresses, 300.0)
                )
            publisher.name, publisher.daemon = "gradhub-publish", True
            publisher.start()
        # torchrun's per-attempt error files, read when a worker fails; without
        # a --log-dir it makes a /tmp/torchelastic_* folder per job and leaves it.
        with tempfile.TemporaryDirectory(prefix="gradhub-run-") as logs:
            if config.survive:
                from gradhub.cli.supervisor import supervise

                if place is None:
                    return supervise(config, logs, "127.0.0.1", port, hosting=True)
                if place.is_host != (config.node_rank == 0):
                    raise InvalidOptionError(
                        "--survive across nodes: node 0 keeps the membership, so "
                        "--rdzv-endpoint must be node 0's address"
                    )
                addr, at = place.endpoint_addr, place.endpoint_port
                return supervise(config, logs, addr, at, hosting=place.is_host)
            args = get_args_parser().parse_args(
                [f"--log-dir={logs}", *torchrun_args(config, port, place)]
            )
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
