"""``gradhub serve``: run one parameter-server process (a thin front over ServerConfig).

Its flags are generated from :class:`~gradhub.ps.server.config.ServerConfig`: one
source of defaults and help texts. One default differs on the command line:
``--bind`` is ``tcp://127.0.0.1:5555`` (a fixed port workers can be told).
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from gradhub.cli._flags import add_config_flags, config_kwargs
from gradhub.errors import GradhubError
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.server import Server, configure_process

_SKIP = ("name",)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="run a parameter server (ZeroMQ)",
        description="Run one parameter-server process until SIGTERM or Ctrl-C: workers "
        "(RemoteParameterServer, the ps-* strategies) init, push and pull keys at --bind. "
        "The optimizer of every key is the workers' (the one their init brings) unless "
        "--optimizer, --lr or --momentum fix it here; then a worker whose optimizer "
        "differs fails with OptimizerMismatchError. Anything but a loopback --bind needs "
        "--secret-file.",
    )
    add_config_flags(p, ServerConfig, skip=_SKIP, defaults={"bind": "tcp://127.0.0.1:5555"})
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = ServerConfig(**config_kwargs(args, ServerConfig, skip=_SKIP))
        configure_process(config)
        server = Server(config)
    except (ValueError, OSError, GradhubError) as exc:
        print(f"gradhub serve: {exc}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    print(f"gradhub serve: listening on {server.address}", flush=True)
    try:
        server.serve()
    except KeyboardInterrupt:
        server.close()
    return 0
