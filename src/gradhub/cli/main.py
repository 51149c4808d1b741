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
from gradhub.errors import GradhubError

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
    """Run one command; a :class:`~gradhub.errors.GradhubError` (a run folder in
    use, a missing secret file, ...) is one line on stderr and exit status 2."""
    parser = build_parser()
    words = sys.argv[1:] if argv is None else list(argv)
    command = next((f"{parser.prog} {w}" for w in words if w in _COMMANDS), parser.prog)
    try:
        args = parser.parse_args(words)  # reading a --secret-file may raise
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        )
        code: int = args.handler(args)
    except GradhubError as exc:
        print(f"{command}: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
