"""DiLoCo against ``allreduce`` over a slow link: wall time and bytes for the same samples.

Two emulated hosts (``tests/cluster.py``: a network namespace each behind a
bridge, a ``tbf`` limit of the link rate on both ends, offloads off; root
needed; ``100mbit`` is added to its link profiles here), one rank on each,
gloo over the hosts' ``eth0``, one intra-op thread per rank. The model is
``examples/diloco_lm.py``'s GPT (``--width``, ``--layers``) on the standard
library's source, the inner optimizer AdamW.
In every round each contender trains ``--steps`` steps from the same initial
weights on the same batches (a multiple of every H, so each run ends right
after a sync), the order rotating round by round:

- ``allreduce``: the gradient averaged every step (DDP's arithmetic), the peer;
- ``diloco H=...``: ``strategy="diloco"`` with ``inner_steps=H`` (the default
  outer optimizer: SGD, lr 0.7, Nesterov momentum 0.9);
- ``streaming H=... F=4 fp4``: ``fragments=4``, ``compress="fp4"``.

Rank 0 times the ``--steps`` steps (forward to optimizer step, a barrier
before) and reads how many bytes its host sent (``eth0``'s counter: measured,
headers and the small check-ins included). Reported: the median wall time
to the run's samples (``steps * batch * 2``) and its min-max over the
rounds, the ratio to ``allreduce`` (< 1: faster), the MB host 0 sent and
its ratio. Both hosts share this machine's cores: the compute is slowed by
whatever else runs; read the ratios. Writes ``diloco_link.json`` and
``diloco_link.md`` to ``--out``. The namespaces, veths and the bridge are
removed at the end, also after a failure or SIGTERM (``Cluster.close``).

    sudo python benchmarks/diloco_link.py [--rates 100mbit,1gbit] [--steps 40] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))

PEER = "allreduce"
CONTENDERS: dict[str, dict[str, Any]] = {
    PEER: {"strategy": "allreduce"},
    "diloco H=20": {"strategy": "diloco", "inner_steps": 20},
    "streaming H=20 F=4 fp4": {
        "strategy": "diloco",
        "inner_steps": 20,
        "fragments": 4,
        "compress": "fp4",
    },
}


def tx_bytes() -> int:
    return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())


def worker(args: argparse.Namespace) -> None:
    from diloco_lm import corpus
    from nanogpt_model import GPT, GPTConfig

    import gradhub

    torch.set_num_threads(1)
    data = corpus(2_000_000)
    config = GPTConfig(
        block_size=args.seq,
        vocab_size=256,
        n_layer=args.layers,
        n_head=max(1, args.width // 64),
        n_embd=args.width,
    )
    with gradhub.init(timeout=600) as runtime:
        draw = torch.Generator().manual_seed(runtime.rank)
        batches = []
        for _ in range(args.steps):
            starts = torch.randint(0, len(data) - args.seq - 1, (args.batch,), generator=draw)
            x = torch.stack([data[s : s + args.seq] for s in starts]).long()
            y = torch.stack([data[s + 1 : s + args.seq + 1] for s in starts]).long()
            batches.append((x, y))
        names = list(CONTENDERS)
        seconds: dict[str, list[float]] = {n: [] for n in names}
        sent: dict[str, list[float]] = {n: [] for n in names}
        losses: dict[str, list[float]] = {n: [] for n in names}
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                options = dict(CONTENDERS[name])
                torch.manual_seed(0)
                model = GPT(config)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
                model, opt = gradhub.prepare(model, opt, runtime=runtime, **options)
                torch.distributed.barrier()
                before, t0 = tx_bytes(), time.perf_counter()
                for x, y in batches:
                    opt.zero_grad(set_to_none=True)
                    _, loss = model(x, y)
                    loss.backward()
                    opt.step()
                seconds[name].append(time.perf_counter() - t0)
                sent[name].append(float(tx_bytes() - before))
                losses[name].append(float(loss.detach()))
                model.close()
        torch.distributed.barrier()
        if runtime.rank == 0:
            params = sum(p.numel() for p in GPT(config).parameters())
            report = {"params": params, "seconds": seconds, "sent": sent, "loss": losses}
            Path(args.result).write_text(json.dumps(report))


def launch(
    cluster: Any, argv: list[str], result: Path, per_host: int = 1, timeout: float = 3600
) -> dict[str, Any]:
    """``argv`` (a worker's command line) as ``per_host`` ranks in every host of
    ``cluster`` (rank ``r`` on host ``r // per_host``; gloo's rendezvous on host
    0's address), to the end; the JSON report rank 0 wrote to ``result``."""
    world = len(cluster.hosts) * per_host
    procs, logs = [], []
    for rank in range(world):
        env = {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank % per_host),
            "LOCAL_WORLD_SIZE": str(per_host),
            "MASTER_ADDR": cluster.hosts[0].addr,
            "MASTER_PORT": "29500",
            "OMP_NUM_THREADS": "1",
        }
        log = result.with_name(f"{result.stem}-rank{rank}.log")
        logs.append(log)
        with log.open("w") as out:
            host = cluster.hosts[rank // per_host]
            procs.append(cluster.popen(host, argv, env=env, stdout=out, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout) for p in procs]
    if any(codes):
        tails = "\n".join(log.read_text()[-3000:] for log in logs)
        raise RuntimeError(f"ranks exited with {codes}:\n{tails}")
    report: dict[str, Any] = json.loads(result.read_text())
    return report


def run_rate(cluster: Any, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Both ranks inside their hosts, to the end; rank 0's report."""
    result = tmp / f"result-{cluster.rate}.json"
    flags = ["--steps", str(args.steps), "--rounds", str(args.rounds), "--batch",
             str(args.batch), "--seq", str(args.seq), "--width", str(args.width),
             "--layers", str(args.layers), "--result", str(result)]  # fmt: skip
    return launch(cluster, [sys.executable, __file__, "--worker", *flags], result)


def summarise(report: dict[str, Any], rate: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    peer_s = statistics.median(report["seconds"][PEER])
    peer_b = statistics.median(report["sent"][PEER])
    rows = []
    for name in CONTENDERS:
        secs, sent = report["seconds"][name], report["sent"][name]
        rows.append(
            {
                "rate": rate,
                "setting": name,
                "samples": args.steps * args.batch * 2,
                "seconds": statistics.median(secs),
                "seconds_min": min(secs),
                "seconds_max": max(secs),
                "time_vs_allreduce": statistics.median(secs) / peer_s,
                "mb_sent": statistics.median(sent) / 1e6,
                "bytes_vs_allreduce": statistics.median(sent) / peer_b,
                "last_loss": statistics.median(report["loss"][name]),
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| link | setting | samples | wall s (min-max) | vs allreduce | MB host 0 sent "
        "| vs allreduce | last training loss |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']} | {r['setting']} | {r['samples']:,} | {r['seconds']:.1f} "
            f"({r['seconds_min']:.1f}-{r['seconds_max']:.1f}) | {r['time_vs_allreduce']:.2f}x "
            f"| {r['mb_sent']:,.1f} | {r['bytes_vs_allreduce']:.4f}x | {r['last_loss']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rates", default="100mbit,1gbit", help="comma-separated: 100mbit, 1gbit, 10gbit"
    )
    parser.add_argument("--steps", type=int, default=40, help="a multiple of every H (20)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="windows per rank per step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    import cluster as emulated
    from _common import machine_note, write_results
    from cluster import Cluster

    emulated.RATES.setdefault("100mbit", 100_000_000)  # a slow WAN-like link

    why = Cluster.unavailable()
    if why is not None:
        print(f"diloco_link: cannot build the emulated hosts: {why}", file=sys.stderr)
        sys.exit(2)
    # SIGTERM unwinds like Ctrl-C, so the cluster's close() removes what it made.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    before = machine_note()
    rows: list[dict[str, Any]] = []
    params = 0
    with tempfile.TemporaryDirectory() as tmp_name:
        for rate in args.rates.split(","):
            with Cluster(2, rate=rate) as cluster:
                report = run_rate(cluster, args, Path(tmp_name))
            params = report["params"]
            rows += summarise(report, rate, args)
    after = os.getloadavg()
    meta = {
        "machine": platform.platform(),
        "torch": torch.__version__,
        "params": params,
        "flags": {k: v for k, v in vars(args).items() if k not in ("worker", "result", "out")},
        "copy_bandwidth": before,
        "loadavg_after": list(after),
    }
    text = (
        f"examples/diloco_lm.py's GPT ({params:,} parameters) on 2 emulated hosts x 1 rank, "
        f"a tbf link between them, {args.steps} steps of {args.batch} x {args.seq} bytes per "
        f"rank, {args.rounds} rounds (order rotating); load average "
        f"{before['loadavg'][0]:.2f} before, {after[0]:.2f} after. Bytes are eth0's counter "
        f"on host 0.\n\n{markdown(rows)}\n"
    )
    write_results(args.out, "diloco_link", {"meta": meta, "rows": rows}, text)
    print(text)


if __name__ == "__main__":
    main()
