"""``gradhub serve``: run one parameter-server process (a thin front over ServerConfig).

Its flags are generated from :class:`~gradhub.ps.server.config.ServerConfig`: one
source of defaults and help texts. One default differs on the command line:
``--bind`` is ``tcp://127.0.0.1:5555`` (a fixed port workers can be told).
One flag is the command line's own: ``--nesterov`` (SGD's Nesterov momentum,
folded into the fixed optimizer's spec: the outer optimizer of strategy
``diloco`` with servers is SGD with lr 0.7, Nesterov momentum 0.9).
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Any

from gradhub.cli._flags import add_config_flags, config_kwargs
from gradhub.errors import GradhubError, InvalidOptionError
from gradhub.optim import OptimizerSpec
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
        "--optimizer, --lr, --momentum or --nesterov fix it here; then a worker whose optimizer "
        "differs fails with OptimizerMismatchError. Anything but a loopback --bind needs "
        "--secret-file.",
    )
    add_config_flags(p, ServerConfig, skip=_SKIP, defaults={"bind": "tcp://127.0.0.1:5555"})
    p.add_argument(
        "--nesterov",
        action="store_true",
        help="with --momentum M: SGD with Nesterov momentum (the outer optimizer of "
        "strategy diloco with servers: --lr 0.7 --momentum 0.9 --nesterov)",
    )
    p.set_defaults(handler=run)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The :class:`ServerConfig` of ``gradhub serve``'s flags (``--nesterov`` folded
    into the fixed optimizer's spec)."""
    kwargs = config_kwargs(args, ServerConfig, skip=_SKIP)
    if args.nesterov:
        name, lr, momentum = kwargs.get("optimizer"), kwargs.get("lr"), kwargs.get("momentum")
        if name not in (None, "sgd") or not momentum:
            raise InvalidOptionError(
                f"--nesterov is SGD's Nesterov momentum: it needs --momentum M > 0 and no "
                f"--optimizer other than sgd (got --optimizer {name}, --momentum {momentum})"
                "\n- help: e.g. --optimizer sgd --lr 0.7 --momentum 0.9 --nesterov (diloco's "
                "outer optimizer)"
            )
        lr = 0.01 if lr is None else lr
        spec = OptimizerSpec.of("sgd", lr=lr, momentum=momentum, nesterov=True)
        kwargs.update(optimizer=spec, lr=None, momentum=None)
    return ServerConfig(**kwargs)


def run(args: argparse.Namespace) -> int:
    try:
        config = server_config(args)
        configure_process(config)
        server = Server(config)
    except (ValueError, OSError, GradhubError) as exc:
        print(f"gradhub serve: {' '.join(str(exc).split())}", file=sys.stderr)  # one line
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    print(f"gradhub serve: listening on {server.address}", flush=True)
    try:
        server.serve()
    except KeyboardInterrupt:
        server.close()
    return 0
