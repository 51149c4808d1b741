"""A small training job for the multi-host tests, run by ``gradhub run`` on every node.

Each strategy named in ``--strategies`` trains the tiny model of
``train_helpers`` for ``--steps`` steps on one fixed global batch (sample i
on rank i % world size) and saves every rank's parameters to
``OUT/<strategy>.rank<r>.pt``. ``ps-sync`` uses the servers ``gradhub run
--servers`` started; ``ps-async`` uses ``--async-server`` (started with
``gradhub serve`` elsewhere). With ``--refused-check``, rank 0 then talks to
the ``--async-server`` without the secret and records what happened in
``OUT/refused.json`` (the error's class, message and seconds taken, each way).

With ``--flat``, ``allreduce`` and ``sharded`` run once more on the flat ring
(``GRADHUB_TRANSPORT=ring``; the first run takes the job's own transport,
hierarchical across hosts holding several ranks), saved as
``OUT/<strategy>-flat.rank<r>.pt``. With ``--count-bytes IFNAME`` the first
rank of each host reads how many bytes its host sent on ``IFNAME`` during one
all-reduce of :data:`COUNTED` fp32 elements on either transport and writes
them to ``OUT/bytes.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "train")
)

import gradhub
from gradhub.collective import all_reduce
from gradhub.ps.secret import read_secret_file
from gradhub.train.strategies import make_strategy
from gradhub.transports import choice as transport
from train_helpers import fixed_data, tiny_model

GLOBAL_BATCH = 16
REFUSAL_WAIT = 30.0
"""Seconds the ``--refused-check`` clients wait for the server (their timeouts)."""
COUNTED = 2_000_000
"""Elements of the all-reduce whose bytes between hosts are counted (8 MB)."""


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


def refused(address: str, secret: bytes | None) -> dict[str, Any]:
    """Pull from ``address`` without the secret, then with it; say what happened.

    The client waits up to :data:`REFUSAL_WAIT` seconds for the server, so a
    refusal (one round trip) and a timeout are far apart in ``seconds``.
    """
    from gradhub.ps.client.remote import RemoteParameterServer

    def pull(worker_id: int, key: bytes | None) -> dict[str, Any]:
        begin = time.monotonic()
        try:
            with RemoteParameterServer(
                [address],
                worker_id=worker_id,
                secret=key,
                timeout=REFUSAL_WAIT,
                connect_timeout=REFUSAL_WAIT,
            ) as ps:
                ps.pull("0.weight", torch.zeros(16, 6)).result(timeout=2 * REFUSAL_WAIT)
        except gradhub.GradhubError as exc:
            error: str | None = type(exc).__name__
            message = str(exc)
        else:
            error, message = None, ""
        return {"error": error, "message": message, "seconds": time.monotonic() - begin}

    return {"without": pull(1000, None), "with": pull(1001, secret)}


def sent_bytes(runtime: gradhub.Runtime, ifname: str) -> tuple[str | None, int | None]:
    """The runtime's transport and the bytes this host sent during one
    all-reduce of COUNTED elements on it (read by the first rank of each host,
    else ``None``)."""
    counter = Path(f"/sys/class/net/{ifname}/statistics/tx_bytes")
    x = torch.ones(COUNTED)
    all_reduce(x, group=runtime.group).wait()  # set-up, buffers
    runtime.all_reduce_sum(torch.zeros(1))  # both hosts idle before the count
    before = int(counter.read_text()) if runtime.local_rank == 0 else 0
    runtime.all_reduce_sum(torch.zeros(1))
    all_reduce(x, group=runtime.group).wait()
    runtime.all_reduce_sum(torch.zeros(1))
    sent = int(counter.read_text()) - before if runtime.local_rank == 0 else None
    return transport.chosen(runtime.group), sent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--strategies", required=True, help="comma-separated")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--secret-file")
    p.add_argument("--async-server")
    p.add_argument("--refused-check", action="store_true")
    p.add_argument("--flat", action="store_true")
    p.add_argument("--count-bytes", metavar="IFNAME")
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
            report = refused(args.async_server, secret)
            (out / "refused.json").write_text(json.dumps(report))
        sent: dict[str, tuple[str | None, int | None]] = {}
        if args.count_bytes:
            sent["auto"] = sent_bytes(runtime, args.count_bytes)
        if args.flat or args.count_bytes:
            os.environ["GRADHUB_TRANSPORT"] = "ring"  # read by the groups set up from here on
            with gradhub.init(timeout=60) as flat:  # wraps the job's process group
                for name in ("allreduce", "sharded") if args.flat else ():
                    params = train(name, flat, args.steps, {})
                    torch.save(params, out / f"{name}-flat.rank{runtime.rank}.pt")
                if args.count_bytes:
                    sent["ring"] = sent_bytes(flat, args.count_bytes)
        if runtime.local_rank == 0 and sent:
            counts = {**sent, "vector_bytes": 4 * COUNTED}
            (out / f"bytes.rank{runtime.rank}.json").write_text(json.dumps(counts))


if __name__ == "__main__":
    main()
