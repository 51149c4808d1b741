"""``gradhub`` command line: a thin front over the library.

Each subcommand lives in its own module with ``add_parser(subparsers)`` and
``run(args) -> int``; add it to ``_COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from gradhub._version import __version__

_COMMANDS = ("demo", "plot", "run", "serve")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradhub", description="Distributed data-parallel training on PyTorch."
    )
    parser.add_argument("--version", action="version", version=f"gradhub {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in _COMMANDS:
        module = importlib.import_module(f"gradhub.cli.{name}")
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
