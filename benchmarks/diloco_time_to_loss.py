"""DiLoCo against ``allreduce`` over a slow link: the wall time to ``allreduce``'s validation loss.

Two emulated hosts behind a ``tbf`` link (``tests/cluster.py``, started as
``benchmarks/diloco_link.py`` starts them; ``100mbit`` and ``10mbit`` are
added to its link profiles here), two ranks on each (4 workers: the shared
memory transport inside a host, one ring between the hosts), gloo over
``eth0``, one intra-op thread per rank. The model, data and loop are
``examples/diloco_lm.py``'s (its ``corpus``, per-rank windows, warmup and
cosine decay to 10 %, clipping at 1.0, ``evaluate`` on ``--eval-windows``
evenly spaced validation windows), the contenders ``benchmarks/diloco.py``'s
settings of the same names:

- ``allreduce`` (inner lr 1e-3, the example's) and ``allreduce lr=4e-3``
  (the tuned peer): ``--steps`` steps each, evaluated every ``--eval-every``
  steps; each one's final validation loss is a target;
- the ``--contenders`` (default ``diloco H=100 lr=4e-3 outer-momentum=0.6``
  and its streaming form, ``F=4 fp4``; any of ``diloco.py``'s settings):
  evaluated every H steps, right after the outer step, on the
  shared weights (the strategy's ``shared``: the last sync's, for every
  fragment); they train until their loss is at or below every target of the
  round, or ``--cap`` steps (the learning rate stays at its 10 % floor past
  ``--steps``).

Clock: rank 0's, from a barrier before the first step; it is paused around
every evaluation (rank 0 evaluates, then broadcasts the loss so that every
rank stops at the same step), so the times are training time only; host 0's
``eth0`` byte counter (both of its ranks) is read at the same moments, the
evaluation's own bytes left out. A contender's time to a target is the
clock at its first evaluation at or below it. Reported per rate: each
contender's time and host 0's MB to each target and the ratio to the peer
whose final loss it is (< 1: sooner), its best loss, its seconds per step.

Rank 0 also times the optimizer steps that sync (diloco: every ``H / F``-th
step; the exchange runs inside them, ``overlap=0``): the part of a
contender's time the link can change; the rest is compute.

``--peers-from RECORD``: the peers are not run again; their runs at each
rate are the record's (``diloco_time_to_loss.json``), their final losses the
targets (a run's losses are the same at every rate: the arithmetic does not
depend on the link). The table marks their rows; ``--name`` keeps such a
run's files apart from the record's.

Both hosts share this machine's cores (the compute is time-sliced between
the 4 ranks and whatever else runs): read the ratios. Writes
``diloco_time_to_loss.json`` and ``.md`` to ``--out``; the namespaces,
veths and the bridge are removed at the end, also after a failure.

    sudo python benchmarks/diloco_time_to_loss.py [--rates 100mbit:2,10mbit:1] [--steps 1000]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _common import write_results

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "examples"))
sys.path.insert(0, str(REPO / "benchmarks"))

PEER, TUNED = "allreduce", "allreduce lr=4e-3"
DILOCO = "diloco H=100 lr=4e-3 outer-momentum=0.6"
STREAMING = "streaming H=100 F=4 fp4 lr=4e-3 outer-momentum=0.6"
CONTENDERS = [DILOCO, STREAMING]
"""The default ``--contenders`` (any of ``diloco.py``'s settings), run after the peers."""
PEERS = (PEER, TUNED)
PER_HOST = 2
LINKS = {"100mbit": 100_000_000, "10mbit": 10_000_000}


def example_args(name: str, args: argparse.Namespace) -> argparse.Namespace:
    """The example's arguments for contender ``name`` (``diloco.py``'s flags)."""
    import diloco_lm

    from diloco import flags

    model = ["--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps),
             "--batch", str(args.batch), "--seq", str(args.seq), "--device", "cpu"]  # fmt: skip
    return diloco_lm.parse_args([*flags(name), *model])


def lr_scale(step: int, steps: int) -> float:
    """The example's schedule (warmup, cosine to 10 %), held at 10 % past ``steps``."""
    warmup = max(1, steps // 20)
    progress = min(1.0, max(0.0, (step - warmup) / max(1, steps - warmup)))
    return min(1.0, step / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(name: str, args: argparse.Namespace, runtime: Any, stop_at: float) -> dict[str, Any]:
    """One contender from the start; its evaluations ``[step, seconds, bytes, loss]``."""
    import diloco_lm
    from nanogpt_model import GPT, GPTConfig

    import gradhub
    from diloco_link import tx_bytes

    ex = example_args(name, args)
    data = diloco_lm.corpus(ex.corpus_bytes)
    split = len(data) * 9 // 10
    train_bytes, val = data[:split], data[split:]
    torch.manual_seed(ex.seed)
    config = GPTConfig(block_size=ex.seq, vocab_size=256, n_layer=ex.layers,
                       n_head=max(1, ex.width // 64), n_embd=ex.width)  # fmt: skip
    raw = GPT(config)
    judged = copy.deepcopy(raw) if ex.strategy == "diloco" else raw  # takes the shared weights
    opt = torch.optim.AdamW(raw.parameters(), lr=ex.lr, weight_decay=0.1)
    model, opt = gradhub.prepare(raw, opt, strategy=ex.strategy, **diloco_lm.options(ex))
    shared: list[torch.Tensor] = getattr(model.strategy, "shared", [])
    every = ex.inner_steps if ex.strategy == "diloco" else args.eval_every
    last = args.steps if name in PEERS else args.cap
    draw = torch.Generator().manual_seed(ex.seed * 1000 + runtime.rank)
    loss_box = torch.zeros(1)
    curve: list[list[float]] = []
    torch.distributed.barrier()
    clock, sent, paused, paused_bytes = time.perf_counter(), tx_bytes(), 0.0, 0
    in_syncs = 0.0
    sync_every = ex.inner_steps // ex.fragments if ex.strategy == "diloco" else 0
    for step in range(1, last + 1):
        starts = torch.randint(0, len(train_bytes) - ex.seq - 1, (ex.batch,), generator=draw)
        x = torch.stack([train_bytes[s : s + ex.seq] for s in starts]).long()
        y = torch.stack([train_bytes[s + 1 : s + ex.seq + 1] for s in starts]).long()
        for group in opt.param_groups:
            group["lr"] = ex.lr * lr_scale(step, ex.steps)
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        begin = time.perf_counter()
        opt.step()
        if sync_every and step % sync_every == 0:
            in_syncs += time.perf_counter() - begin
        if step % every and step != last:
            continue
        pause, pause_bytes = time.perf_counter(), tx_bytes()
        seconds, nbytes = pause - clock - paused, pause_bytes - sent - paused_bytes
        if runtime.rank == 0:
            with torch.no_grad():
                trainable = [p for p in judged.parameters() if p.requires_grad]
                for p, s in zip(trainable if judged is not raw else [], shared, strict=True):
                    p.copy_(s)
            loss_box.fill_(diloco_lm.evaluate(judged, val, ex.seq, args.eval_windows))
        torch.distributed.broadcast(loss_box, 0)
        curve.append([step, seconds, nbytes, float(loss_box), in_syncs])
        paused += time.perf_counter() - pause
        paused_bytes += tx_bytes() - pause_bytes
        if float(loss_box) <= stop_at:
            break
    model.close()
    return {"curve": curve, "eval_seconds": paused}


def worker(args: argparse.Namespace) -> None:
    import gradhub

    torch.set_num_threads(1)
    contenders = [*PEERS, *args.contenders.split(",")]
    names = [n for n in contenders if n not in args.skip.split(",")]
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    with gradhub.init(timeout=1800) as runtime:
        for r in range(args.rounds):
            targets = [float(t) for t in args.targets.split(",") if t]  # or the peers' first
            for name in names:
                run = train(name, args, runtime, -math.inf if name in PEERS else min(targets))
                if name in PEERS:
                    targets.append(run["curve"][-1][3])
                runs[name].append(run)
                if runtime.rank == 0:
                    print(f"round {r} {name}: {run['curve'][-1]}", flush=True)
        torch.distributed.barrier()
        if runtime.rank == 0:
            Path(args.result).write_text(json.dumps(runs))


def reach(curve: list[list[float]], target: float) -> list[float] | None:
    """The first evaluation ``[step, seconds, bytes, loss, sync seconds]`` at or below
    ``target``."""
    return next((point for point in curve if point[3] <= target), None)


def summarise(rate: str, runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    targets = {p: statistics.median(r["curve"][-1][3] for r in runs[p]) for p in PEERS}
    peer_at = {p: [reach(r["curve"], targets[p]) for r in runs[p]] for p in PEERS}
    rows = []
    for name, done in runs.items():
        row: dict[str, Any] = {"rate": rate, "contender": name, "rounds": len(done)}
        row["recorded"] = bool(done[0].get("recorded"))
        for p in PEERS:
            hits = [reach(r["curve"], targets[p]) for r in done]
            reached = [h for h in hits if h is not None]
            base = statistics.median(h[1] for h in peer_at[p] if h is not None)
            row[f"to {p}"] = None
            if len(reached) == len(hits):
                row[f"to {p}"] = {
                    "target": targets[p],
                    "step": statistics.median(h[0] for h in reached),
                    "seconds": statistics.median(h[1] for h in reached),
                    "seconds_min": min(h[1] for h in reached),
                    "seconds_max": max(h[1] for h in reached),
                    "vs_peer": statistics.median(h[1] for h in reached) / base,
                    "mb_sent": statistics.median(h[2] for h in reached) / 1e6,
                    "sync_seconds": statistics.median(h[4] for h in reached)
                    if all(len(h) > 4 for h in reached)
                    else None,
                }
        best = [min(r["curve"], key=lambda p: p[3]) for r in done]
        row["best_loss"] = statistics.median(b[3] for b in best)
        row["best_step"] = statistics.median(b[0] for b in best)
        row["steps_run"] = statistics.median(r["curve"][-1][0] for r in done)
        row["s_per_step"] = statistics.median(r["curve"][-1][1] / r["curve"][-1][0] for r in done)
        row["eval_s_excluded"] = statistics.median(r["eval_seconds"] for r in done)
        rows.append(row)
    return rows


def cell(hit: dict[str, Any] | None, best: float) -> str:
    if hit is None:
        return f"not reached (best {best:.4f}) | - | -"
    spread = f"{hit['seconds']:.0f}" + (
        f" ({hit['seconds_min']:.0f}-{hit['seconds_max']:.0f})"
        if hit["seconds_max"] > hit["seconds_min"]
        else ""
    )
    return f"{spread} @ step {hit['step']:.0f} | {hit['vs_peer']:.3f}x | {hit['mb_sent']:,.2f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"| link | contender | rounds | s to {PEER}'s loss | vs {PEER} | MB host 0 sent "
        f"| of which s in syncs | s to {TUNED}'s loss | vs {TUNED} | MB host 0 sent "
        "| best loss (step) | s/step |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        mark = " (the record's runs)" if r["recorded"] else ""
        hit = r[f"to {PEER}"]
        syncs = "-" if hit is None or not hit["sync_seconds"] else f"{hit['sync_seconds']:.1f}"
        lines.append(
            f"| {r['rate']} | {r['contender']}{mark} | {r['rounds']} "
            f"| {cell(hit, r['best_loss'])} | {syncs} | {cell(r[f'to {TUNED}'], r['best_loss'])} "
            f"| {r['best_loss']:.4f} ({r['best_step']:.0f}) | {r['s_per_step']:.3f} |"
        )
    return "\n".join(lines)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="100mbit:2,10mbit:1", help="RATE:ROUNDS, ...")
    parser.add_argument("--steps", type=int, default=1000, help="the peers' steps (schedule)")
    parser.add_argument("--cap", type=int, default=None, help="diloco's most steps (2x --steps)")
    parser.add_argument("--eval-every", type=int, default=50, help="the peers' evaluations")
    parser.add_argument("--eval-windows", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="windows per rank per step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help="diloco.py settings, comma-separated"
    )
    parser.add_argument("--peers-from", default=None, help="a record whose peer runs to reuse")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--name", default="diloco_time_to_loss", help="the results' file name")
    parser.add_argument("--rounds", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--skip", default="", help=argparse.SUPPRESS)
    parser.add_argument("--targets", default="", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.cap = args.cap or 2 * args.steps
    return args


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        return
    import cluster as emulated
    from _common import machine_note
    from cluster import Cluster
    from diloco_link import launch

    for link, bps in LINKS.items():
        emulated.RATES.setdefault(link, bps)
    why = Cluster.unavailable()
    if why is not None:
        print(f"diloco_time_to_loss: cannot build the emulated hosts: {why}", file=sys.stderr)
        sys.exit(2)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: close() runs
    plan = [
        (r.split(":")[0], int(r.split(":")[1]) if ":" in r else 2) for r in args.rates.split(",")
    ]
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k in ("steps", "cap", "eval_every", "eval_windows", "batch", "seq", "width",
                      "layers", "contenders")]  # fmt: skip
    rows: list[dict[str, Any]] = []
    notes: dict[str, Any] = {}
    peers = json.loads(Path(args.peers_from).read_text())["runs"] if args.peers_from else {}
    with tempfile.TemporaryDirectory() as tmp:
        for rate, rounds in plan:
            recorded = {p: [{**r, "recorded": True} for r in peers[rate]["runs"][p]] for p in
                        (PEERS if peers else ())}  # fmt: skip
            skip = ",".join(recorded)
            targets = ",".join(str(r[0]["curve"][-1][3]) for r in recorded.values())
            result = Path(tmp) / f"result-{rate}.json"
            argv = [sys.executable, __file__, "--worker", *flags, f"--rounds={rounds}",
                    f"--skip={skip}", f"--targets={targets}", f"--result={result}"]  # fmt: skip
            before = machine_note()
            with Cluster(2, rate=rate) as cluster:
                runs = launch(cluster, argv, result, per_host=PER_HOST, timeout=7200)
            notes[rate] = {"before": before, "loadavg_after": list(os.getloadavg())}
            runs = {**recorded, **runs}
            rows += summarise(rate, runs)
            notes[rate]["runs"] = runs
            record(args, rows, notes)  # after every rate: a later failure keeps these


def record(args: argparse.Namespace, rows: list[dict[str, Any]], notes: dict[str, Any]) -> None:
    meta = {"machine": platform.platform(), "torch": torch.__version__, "flags": vars(args)}
    load = "; ".join(
        f"{rate}: load {n['before']['loadavg'][0]:.2f} before, {n['loadavg_after'][0]:.2f} after, "
        f"one-thread copy {n['before']['copy_GBps_median']:.1f} GB/s"
        for rate, n in notes.items()
    )
    text = (
        f"examples/diloco_lm.py's GPT (`--width {args.width} --layers {args.layers} --batch "
        f"{args.batch} --seq {args.seq}`) on 2 emulated hosts x {PER_HOST} ranks, a tbf link; "
        f"peers {args.steps} steps, diloco up to {args.cap}; validation on "
        f"{args.eval_windows} windows; times exclude the evaluations. {load}.\n\n"
        f"{markdown(rows)}\n"
    )
    write_results(args.out, args.name, {"meta": meta, "rows": rows, "runs": notes}, text)
    print(text)


if __name__ == "__main__":
    main()
