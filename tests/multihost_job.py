"""A small training job for the multi-host tests, run by ``gradhub run`` on every node.

Each strategy named in ``--strategies`` trains the tiny model of
``train_helpers`` for ``--steps`` steps on one fixed global batch (sample i
on rank i % world size) and saves every rank's parameters to
``OUT/<strategy>.rank<r>.pt``. ``ps-sync`` uses the servers ``gradhub run
--servers`` started; ``ps-async`` uses ``--async-server`` (started with
``gradhub serve`` elsewhere). With ``--refused-check``, rank 0 then talks to
the ``--async-server`` without the secret and records what happened in
``OUT/refused.txt``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gradhub
from gradhub.ps.config import read_secret_file
from gradhub.train.strategies import make_strategy
from train_helpers import fixed_data, tiny_model

GLOBAL_BATCH = 16


def train(
    name: str, runtime: gradhub.Runtime, steps: int, options: dict[str, Any]
) -> list[torch.Tensor]:
    model = tiny_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    strategy = make_strategy(name, **options)
    strategy.setup(model, opt, runtime)
    x, y = fixed_data(n=GLOBAL_BATCH)
    mine = torch.arange(runtime.rank, GLOBAL_BATCH, runtime.world_size)
    xr, yr = x[mine], y[mine]
    for _ in range(steps):
        strategy.step(
            lambda: torch.nn.functional.cross_entropy(model(xr), yr), len(xr), GLOBAL_BATCH
        )
    strategy.refresh()
    strategy.close()
    return [p.detach().clone() for p in model.parameters()]


def refused(address: str, secret: bytes | None) -> str:
    """Pull from ``address`` without the secret, then with it; say what happened."""
    from gradhub.ps.remote import RemoteParameterServer

    def pull(worker_id: int, key: bytes | None) -> str:
        try:
            with RemoteParameterServer([address], worker_id=worker_id, secret=key, timeout=3) as ps:
                ps.pull("0.weight", torch.zeros(16, 6)).result(timeout=10)
        except gradhub.GradhubError as exc:
            return f"refused ({type(exc).__name__}: {exc})"
        return "served"

    return f"without the secret: {pull(1000, None)}; with it: {pull(1001, secret)}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategies", required=True, help="comma-separated")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--secret-file")
    p.add_argument("--async-server")
    p.add_argument("--refused-check", action="store_true")
    args = p.parse_args()
    secret = read_secret_file(args.secret_file) if args.secret_file else None
    out = Path(args.out)
    with gradhub.init(timeout=60) as runtime:
        for name in args.strategies.split(","):
            options: dict[str, Any] = {}
            if name.startswith("ps-"):
                options["secret"] = secret
                if name == "ps-async":
                    options["servers"] = [args.async_server]
            params = train(name, runtime, args.steps, options)
            torch.save(params, out / f"{name}.rank{runtime.rank}.pt")
            runtime.all_reduce_sum(torch.zeros(1))  # every rank done before the next one
        if args.refused_check and runtime.rank == 0:
            (out / "refused.txt").write_text(refused(args.async_server, secret))


if __name__ == "__main__":
    main()
