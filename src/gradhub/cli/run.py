"""``gradhub run -n N [--servers S] [--nnodes M ...] script.py [args]``: a training job.

A thin front over :func:`gradhub.cli.launcher.launch`, which hands the
worker processes to ``torch.distributed.run``. The script calls
``gradhub.init()``; the same script runs under ``torchrun`` unchanged.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gradhub.cli._flags import add_config_flags, config_kwargs
from gradhub.ps.server.config import ServerConfig

# Servers' settings as --ps-* flags, generated from ServerConfig; the job sets
# bind and workers itself.
_PS_SKIP = ("bind", "workers", "name")


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "run",
        help="run a training script on N local processes (torchrun underneath)",
        description="Run SCRIPT on N local worker processes through torch.distributed.run. "
        "With --servers, start parameter servers first; the ps-* strategies find them.",
    )
    p.add_argument("-n", "--nproc", type=int, required=True, help="worker processes (on this node)")
    p.add_argument(
        "--servers",
        type=int,
        default=0,
        help="parameter servers to start first (in --ps-mode, default async: the ps-* "
        "strategies; strategy diloco needs --ps-mode sync, or ssp for diloco_mode='async')",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="when a worker fails, restart all workers, up to N times (torchrun's elastic "
        "agent); fit() then checkpoints (into checkpoint_dir, default run_dir/checkpoints) "
        "and resumes from the last checkpoint every rank has; parameter servers keep "
        "running (default: 0, a failed worker ends the job). With --survive: replace a "
        "dead worker by a new one, up to N times, which joins the running job",
    )
    p.add_argument(
        "--survive",
        action="store_true",
        help="a worker's death ends only that worker: the others regroup over the "
        "survivors, redo the failed step on the same global batch and go on (one node; "
        "strategies allreduce, sharded, diloco: diloco redoes the sync over the survivors)",
    )
    p.add_argument(
        "--min-workers",
        type=int,
        default=1,
        metavar="M",
        help="with --survive: stop the job when fewer than M workers are left (default 1)",
    )
    ps = p.add_argument_group("parameter servers (with --servers)")
    add_config_flags(
        ps,
        ServerConfig,
        prefix="ps-",
        skip=_PS_SKIP,
        aliases={"max_staleness": "--max-staleness"},
    )
    p.add_argument("--master-port", type=int, help="port of the job's store (default: free)")
    nodes = p.add_argument_group(
        "across nodes",
        "torchrun's multi-node options; run the same command on every node. This node's "
        "address, whether it hosts the rendezvous store and GLOO_SOCKET_IFNAME are worked "
        "out from --rdzv-endpoint.",
    )
    nodes.add_argument("--nnodes", type=int, default=1, help="nodes in the job")
    nodes.add_argument(
        "--node-rank", type=int, default=0, help="this node's rank; node 0 starts the servers"
    )
    nodes.add_argument(
        "--rdzv-backend", choices=("c10d", "static"), default="c10d", help="rendezvous backend"
    )
    nodes.add_argument("--rdzv-endpoint", help="HOST[:PORT] of the rendezvous (default port 29400)")
    nodes.add_argument("--rdzv-id", default="none", help="job id, the same on every node")
    nodes.add_argument(
        "--local-addr", help="this node's address for the other nodes (default: worked out)"
    )
    p.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gradhub.cli.launcher import LaunchConfig, launch

    try:
        server = ServerConfig(
            workers=max(1, args.nproc * max(1, args.nnodes)),
            **config_kwargs(args, ServerConfig, prefix="ps-", skip=_PS_SKIP),
        )
        config = LaunchConfig(
            nproc=args.nproc,
            target=[args.script, *args.script_args],
            module=args.module,
            servers=args.servers,
            server=server,
            master_port=args.master_port,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_backend=args.rdzv_backend,
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=args.rdzv_id,
            local_addr=args.local_addr,
            max_restarts=args.max_restarts,
            survive=args.survive,
            min_workers=args.min_workers,
        )
        return launch(config)
    except (ValueError, OSError) as exc:
        print(f"gradhub run: {exc}", file=sys.stderr)
        return 2
