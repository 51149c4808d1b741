"""``gradhub demo``: placeholder until the foundation demo lands."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", help="train on the bundled digits data set")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    raise NotImplementedError
