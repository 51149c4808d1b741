"""Training steps across emulated hosts on 1 and 10 Gbit/s links.

The cluster is the tests' (``tests/cluster.py``): one network namespace per
host behind a bridge, a ``tbf`` limit of the link rate on both ends of every
link, offloads off; a parameter server gets a host of its own. Root needed.

Per link rate and model, one process per rank is started inside its host
(``--layout 2x1``: 2 hosts x 1 rank; ``2x2``: 2 hosts x 2 ranks, ranks 0, 1
on host 0; ``2x2i``: the same with ranks interleaved, 0, 2 on host 0), gloo
over the hosts' ``eth0``, one intra-op thread per rank. In every round each
contender runs ``--steps`` steps on fixed batches, the order rotating round by
round; rank 0 times each step (forward to optimizer step) and reads how many
bytes its host sent (``eth0``'s counter) per step:

- ``DDP fp32``: ``DistributedDataParallel`` (25 MB buckets), the peer;
- ``DDP + PowerSGD hook``: DDP with torch's ``powerSGD_hook`` (rank 4,
  compressing from the third step; the timed steps are all compressed), in
  one bucket: with several, the hook mismatches gloo's collectives
  (pytorch/pytorch#58467);
- ``gradhub allreduce fp32`` / ``bf16`` / ``powersgd``: the ``allreduce``
  strategy with ``compress="none"``, ``"bf16"``, ``"powersgd"`` (rank 4), on
  the job's own transport (the ring at 2 x 1, hierarchical at 2 x 2);
- ``gradhub allreduce fp32 flat ring``: the same with ``transport="ring"``
  (the flat ring across all ranks), the hierarchical path's peer;
- ``gradhub sharded bf16``: ring reduce-scatter + all-gather, bf16 wire;
- ``gradhub ps-async``: push and pull against one server on its own host
  (fp32, HMAC-signed);
- ``local step (no communication)``: each rank steps its own model with no
  gradient exchange, all ranks at once on the same cores: the compute floor,
  so ``DDP fp32 / local step`` is the most any compression can gain here.

Reports the transport each gradhub contender took, the median step time,
the min-max of the round medians, the MB host 0 sent per step and the ratio
to ``DDP fp32`` (< 1: faster). Writes
``network.json`` and ``network.md`` to ``--out`` and prints the table.

    python benchmarks/network.py [--rates 1gbit,10gbit] [--layouts 2x1,2x2] \\
        [--models mlp,transformer] [--rounds 3] [--steps 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

PEER = "DDP fp32"
LOCAL = "local step (no communication)"
CONTENDERS = [
    PEER,
    "DDP + PowerSGD hook",
    "gradhub allreduce fp32",
    "gradhub allreduce fp32 flat ring",
    "gradhub allreduce bf16",
    "gradhub allreduce powersgd",
    "gradhub sharded bf16",
    "gradhub ps-async",
    LOCAL,
]
ON_TRANSPORT = (
    "gradhub allreduce fp32",
    "gradhub allreduce fp32 flat ring",
    "gradhub allreduce bf16",
    "gradhub allreduce powersgd",
    "gradhub sharded bf16",
)
"""The contenders whose collectives take the group's transport (reported per run)."""
OTHER_PATHS = {
    PEER: "gloo all_reduce",
    "DDP + PowerSGD hook": "gloo all_reduce",
    "gradhub ps-async": "ZeroMQ",
    LOCAL: "-",
}
POWERSGD_RANK = 4
MODELS = ("mlp", "transformer")
LABELS = {"mlp": "MLP 20M", "transformer": "Transformer"}


# ------------------------------------------------------------------ models and data
def make_model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "mlp":
        return nn.Sequential(
            nn.Linear(784, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)
        )
    return TinyTransformer()


class TinyTransformer(nn.Module):
    """A 4-layer encoder language model: vocabulary 8192, width 256, 64 tokens."""

    vocab, width, seq = 8192, 256, 64

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(self.vocab, self.width)
        self.pos = nn.Parameter(torch.zeros(self.seq, self.width))
        layer = nn.TransformerEncoderLayer(
            self.width, 4, 4 * self.width, dropout=0.0, batch_first=True
        )
        self.layers = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        self.head = nn.Linear(self.width, self.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.layers(self.embed(tokens) + self.pos))
        return out


def make_batch(name: str, rank: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` samples (MLP) or sequences of 64 tokens (transformer) for ``rank``."""
    g = torch.Generator().manual_seed(1000 + rank)
    if name == "mlp":
        return torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)
    tokens = torch.randint(0, TinyTransformer.vocab, (batch, TinyTransformer.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


# ------------------------------------------------------------------ one rank
def flat_ring(runtime: Any) -> Any:
    """A runtime over the same process group whose collectives take the flat ring."""
    from gradhub.collective import CollectiveGroup

    group = CollectiveGroup(
        runtime.group.process_group, store=runtime.store, timeout=runtime.timeout, transport="ring"
    )
    return dataclasses.replace(runtime, group=group, owns_group=False)


def contenders(
    name: str, runtime: Any, server: str, secret: bytes, batch: int, only: set[str]
) -> tuple[dict[str, Callable[[], None]], list[Any], dict[str, Any]]:
    """Each contender's step, what to close afterwards, and the runtime it runs on."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    from gradhub.train.strategies import make_strategy

    x, y = make_batch(name, runtime.rank, batch)
    world = runtime.world_size
    steps: dict[str, Callable[[], None]] = {}
    closers: list[Any] = []

    def plain_step(model: nn.Module) -> Callable[[], None]:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss_of(model, x, y).backward()
            opt.step()

        return step

    def ddp(hook: bool) -> Callable[[], None]:
        # torch's PowerSGD hook mismatches gloo collectives when several
        # buckets are in flight (its P and Q all-reduces are issued from
        # callbacks; pytorch/pytorch#58467): with the hook, one bucket.
        cap = {"bucket_cap_mb": 1024} if hook else {}
        model = nn.parallel.DistributedDataParallel(make_model(name), **cap)
        if hook:
            state = psgd.PowerSGDState(
                process_group=None, matrix_approximation_rank=POWERSGD_RANK, start_powerSGD_iter=2
            )
            model.register_comm_hook(state, psgd.powerSGD_hook)
        return plain_step(model)

    if PEER in only:
        steps[PEER] = ddp(False)
    if "DDP + PowerSGD hook" in only:
        steps["DDP + PowerSGD hook"] = ddp(True)
    if LOCAL in only:
        steps[LOCAL] = plain_step(make_model(name))
    options: dict[str, dict[str, Any]] = {
        "gradhub allreduce fp32": {},
        "gradhub allreduce fp32 flat ring": {},
        "gradhub allreduce bf16": {"compress": "bf16"},
        "gradhub allreduce powersgd": {
            "compress": "powersgd",
            "compress_options": {"rank": POWERSGD_RANK},
        },
        "gradhub sharded bf16": {"compress": "bf16"},
        "gradhub ps-async": {"servers": [server], "secret": secret},
    }
    runtimes: dict[str, Any] = {}
    last: list[Any] = []
    for label, opts in options.items():
        if label not in only:
            continue
        strategy_name = label.split()[1]
        model = make_model(name)
        try:
            strategy = make_strategy(strategy_name, **opts)
        except (TypeError, ValueError) as exc:  # an option this version does not have
            if runtime.rank == 0:
                print(f"skipping {label}: {exc}", file=sys.stderr)
            continue
        runtimes[label] = runtime
        if label.endswith("flat ring"):
            runtimes[label] = flat_ring(runtime)
            last.append(runtimes[label])
        strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.01), runtimes[label])
        closers.append(strategy)

        def step(model: nn.Module = model, strategy: Any = strategy) -> None:
            strategy.step(lambda: loss_of(model, x, y), len(x), len(x) * world)

        steps[label] = step
    return steps, closers + last, runtimes


def tx_bytes() -> int:
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def worker(args: argparse.Namespace) -> None:
    import gradhub
    from gradhub.transports.choice import chosen

    torch.set_num_threads(1)
    secret = Path(args.secret_file).read_bytes().strip()
    with gradhub.init(timeout=600) as runtime:
        only = set(args.only.split(",")) if args.only else set(CONTENDERS)
        batch = args.batch if args.model == "mlp" else args.seqs
        fns, closers, runtimes = contenders(args.model, runtime, args.server, secret, batch, only)
        for fn in fns.values():  # warm-up: allocations, gloo pairs, PowerSGD's first steps
            for _ in range(3):
                fn()
        transports = {n: chosen(r.group) for n, r in runtimes.items() if n in ON_TRANSPORT}
        names = [n for n in CONTENDERS if n in fns]
        times: dict[str, list[list[float]]] = {n: [] for n in names}
        sent: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for n in order:
                torch.distributed.barrier()
                before = tx_bytes()
                per_step = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    fns[n]()
                    per_step.append(time.perf_counter() - t0)
                sent[n].append((tx_bytes() - before) / args.steps)
                times[n].append(per_step)
        torch.distributed.barrier()
        for c in closers:
            c.close()
        if runtime.rank == 0:
            params = sum(p.numel() for p in make_model(args.model).parameters())
            report = {"params": params, "times": times, "sent": sent, "transports": transports}
            Path(args.result).write_text(json.dumps(report))


# ------------------------------------------------------------------ the driver
def run_one(
    cluster: Any,
    model: str,
    per_host: int,
    interleaved: bool,
    rounds: int,
    steps: int,
    secret: Path,
    tmp: Path,
    only: str,
    batch: int,
    seqs: int,
) -> dict[str, Any]:
    hosts = cluster.hosts[:2]
    server_host = cluster.hosts[2]
    world = len(hosts) * per_host
    gradhub_cli = str(Path(sys.executable).with_name("gradhub"))
    server_addr = f"tcp://{server_host.addr}:5555"
    log = (tmp / f"server-{model}.log").open("w")
    server = cluster.popen(
        server_host,
        [gradhub_cli, "serve", "--bind", server_addr, "--secret-file", str(secret),
         "--mode", "async", "--workers", str(world)],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    result = tmp / f"result-{model}.json"
    procs = []
    port = 29500
    worker_args = ["--model", model, "--rounds", str(rounds), "--steps", str(steps),
                   "--server", server_addr, "--secret-file", str(secret), "--result", str(result),
                   "--only", only, "--batch", str(batch), "--seqs", str(seqs)]  # fmt: skip
    try:
        for rank in range(world):
            where, local = (rank % 2, rank // 2) if interleaved else divmod(rank, per_host)
            host = hosts[where]
            env = {
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(per_host),
                "MASTER_ADDR": hosts[0].addr,
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
            }
            out = (tmp / f"rank{rank}-{model}.log").open("w")
            procs.append(
                cluster.popen(
                    host,
                    [sys.executable, __file__, "--worker", *worker_args],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
            out.close()
        codes = [p.wait(3600) for p in procs]
        if codes != [0] * world:
            logs = "\n".join(
                (tmp / f"rank{r}-{model}.log").read_text()[-3000:] for r in range(world)
            )
            raise RuntimeError(f"ranks exited with {codes}:\n{logs}")
        report: dict[str, Any] = json.loads(result.read_text())
        return report
    finally:
        server.kill()
        server.wait(10)
        log.close()


def summarise(report: dict[str, Any], rate: str, layout: str, model: str) -> list[dict[str, Any]]:
    rows = []
    peer = statistics.median(t for rnd in report["times"][PEER] for t in rnd)
    for name, rounds in report["times"].items():
        flat = [t for rnd in rounds for t in rnd]
        med = statistics.median(flat)
        medians = [statistics.median(rnd) for rnd in rounds]
        rows.append(
            {
                "rate": rate,
                "layout": layout,
                "model": LABELS[model],
                "params": report["params"],
                "method": name,
                "transport": report.get("transports", {}).get(name, OTHER_PATHS.get(name, "?")),
                "median_step_ms": med * 1e3,
                "spread_ms": [min(medians) * 1e3, max(medians) * 1e3],
                "mb_sent_per_step": statistics.median(report["sent"][name]) / 1e6,
                "ratio_to_ddp": med / peer,
                "speedup_vs_ddp": peer / med,
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| link | hosts x ranks | model | method | transport | median step (ms) "
        "| round medians (ms) | MB sent by host 0 per step | speed-up vs DDP fp32 |",
        "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lo, hi = r["spread_ms"]
        lines.append(
            f"| {r['rate']} | {r['layout']} | {r['model']} ({r['params'] / 1e6:.1f}M) "
            f"| {r['method']} | {r['transport']} | {r['median_step_ms']:.0f} | {lo:.0f}-{hi:.0f} "
            f"| {r['mb_sent_per_step']:.2f} | {r['speedup_vs_ddp']:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rates", default="1gbit,10gbit")
    p.add_argument(
        "--layouts",
        default="2x1",
        help="comma-separated HOSTSxRANKS, e.g. 2x1,2x2 (2x2i: ranks interleaved over the hosts)",
    )
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--only", help="comma-separated contenders to run (default: all)")
    p.add_argument("--batch", type=int, default=64, help="MLP samples per rank and step")
    p.add_argument("--seqs", type=int, default=8, help="transformer sequences per rank and step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--server", help=argparse.SUPPRESS)
    p.add_argument("--secret-file", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return

    from _common import write_results
    from cluster import Cluster

    why = Cluster.unavailable()
    if why is not None:
        print(f"benchmarks/network.py needs an emulated cluster: {why}", file=sys.stderr)
        raise SystemExit(2)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        secret = tmp / "secret"
        secret.write_bytes(os.urandom(16).hex().encode())
        for layout in args.layouts.split(","):
            per_host = int(layout.split("x")[1].rstrip("i"))
            with Cluster(3, rate=None) as cluster:
                for rate in args.rates.split(","):
                    cluster.set_rate(rate)
                    for model in args.models.split(","):
                        report = run_one(
                            cluster,
                            model,
                            per_host,
                            layout.endswith("i"),
                            args.rounds,
                            args.steps,
                            secret,
                            tmp,
                            args.only or ",".join(CONTENDERS),
                            args.batch,
                            args.seqs,
                        )
                        rows += summarise(report, rate, layout, model)
                        print(markdown(rows[-len(report["times"]) :]), flush=True)
    meta = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "mlp_samples_per_rank": args.batch,
        "transformer_sequences_per_rank": args.seqs,
        "note": "emulated hosts (network namespaces, tbf) on one machine: the ranks of every "
        "host share its cores",
        "load_average_at_start": os.getloadavg()[0],
    }
    table = markdown(rows)
    write_results(args.out, "network", {"meta": meta, "rows": rows}, table + "\n")
    print(table)


if __name__ == "__main__":
    main()
