"""``gradhub serve``: run one parameter-server process (a thin front over ServerConfig)."""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from gradhub.ps.config import MODES, OPTIMIZERS, ServerConfig, read_secret_file
from gradhub.ps.server import Server, configure_process


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="run a parameter server (ZeroMQ)")
    p.add_argument("--bind", default="tcp://127.0.0.1:5555", help="ZeroMQ endpoint to bind")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd")
    p.add_argument("--lr", type=float, default=0.01, help="learning rate")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum")
    p.add_argument("--mode", choices=MODES, default="async")
    p.add_argument("--workers", type=int, default=1, help="workers a sync round waits for")
    p.add_argument("--max-staleness", type=int, default=0, help="ssp bound, in steps")
    p.add_argument("--secret-file", help="file holding the shared secret (HMAC)")
    p.add_argument("--checkpoint-dir", help="directory for checkpoints (resumed on start)")
    p.add_argument("--checkpoint-every", type=float, default=60.0, help="seconds between them")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0, help="seconds of silence")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = ServerConfig(
            bind=args.bind,
            optimizer=args.optimizer,
            lr=args.lr,
            momentum=args.momentum,
            mode=args.mode,
            workers=args.workers,
            max_staleness=args.max_staleness,
            secret=read_secret_file(args.secret_file) if args.secret_file else None,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every,
            heartbeat_timeout=args.heartbeat_timeout,
            threads=args.threads,
        )
        configure_process(config)
        server = Server(config)
    except (ValueError, OSError) as exc:
        print(f"gradhub serve: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    print(f"gradhub serve: listening on {server.address}", flush=True)
    try:
        server.serve()
    except KeyboardInterrupt:
        server.close()
    return 0
