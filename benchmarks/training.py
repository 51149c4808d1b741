"""Training steps: gradhub ``allreduce`` and ``sharded`` beside DistributedDataParallel.

Two processes on 127.0.0.1 (gloo, one intra-op thread each), MLPs of about
1.9M (784-1024-1024-10) and 21M (1024-4096-4096-10) parameters, 64 samples
per rank per step (global batch 128), SGD. In every round each contender
runs ``--steps`` steps on the same fixed batches, the order rotating round
by round (A, B, C / B, C, A / ...):

- ``DDP``: ``torch.nn.parallel.DistributedDataParallel`` (25 MB buckets) on
  its own gloo group (``dist.new_group``) in the same processes, the peer;
- ``gradhub allreduce``: :class:`gradhub.train.strategies.allreduce.AllReduceStrategy`
  (25 MB buckets, overlapped with backward, sample-weighted);
- ``gradhub sharded``: :class:`gradhub.train.strategies.sharded.ShardedStrategy`
  (reduce-scatter, ZeRO-1 step on the owned slice, all-gather);
- each gradhub strategy twice: ``(shm)`` on the job's group, whose transport is
  shared memory (both ranks on one host), and ``(ring)`` on a second wrapper of
  the same process group pinned to the gloo ring (the path before shared memory);
- ``prepare + allreduce`` / ``prepare + sharded``: the user's own loop
  (``zero_grad``, ``backward``, ``step``) on what :func:`gradhub.prepare`
  returns, on the job's group: the public path of a ported DDP script;
  ``prepare + sharded (no overlap)``: the same with ``overlap=False`` (every
  bucket's reduce-scatter started after backward), to show what starting
  them from the backward hooks gains;
- ``1 process, 2 threads``: the whole global batch in one process with two
  intra-op threads, no communication: what the same two cores do alone;
- ``local step (no communication)``: each rank steps a plain copy of the model
  on its own batch, both ranks at once, timed in the same rounds: the
  compute floor of a step on these cores (forward, backward, SGD step; no
  bucket, no byte travels). On a machine whose cores the two ranks' backward
  passes already fill, a strategy's communication is CPU work added to this
  (overlap hides waiting, not work), so its ratio to DDP bounds every
  strategy's from below.

A step is timed on rank 0 from the start of forward to the end of the
optimizer step (synchronous strategies keep the ranks in lockstep); the CPU
seconds rank 0's process spent meanwhile (every thread, kernel included) are
recorded too: the step's work, which load from other jobs inflates far less
than its wall time (not taken for the single process). Reports
the median step time over all timed steps, the min-max spread of the
per-round medians, samples/s (global batch / median), the ratio of each
median to DDP's (< 1: faster) and the median over rounds of the ratio of the
round's median to DDP's in the same round (robust to load that changes
between rounds; not defined for the single process, timed apart). Also
checks that DDP and gradhub allreduce end with the same parameters (equal
batch sizes: weighted mean == DDP's mean).
Records this machine's one-thread copy bandwidth and the load average before
and after. Writes ``training.json`` and ``training.md`` to ``--out`` and prints
the table.
On a 2-core machine the two ranks fill both cores.

Second table, a backward that leaves the CPU idle (:mod:`_sleeping`: six
16 MB blocks whose backward sleeps 10 ms each, one bucket per block, as the
host waits for a GPU): DDP on gloo, ``prepare`` + allreduce and + sharded,
beside the same step with no communication and the bucket all-reduces
alone (gloo's, and gradhub's on the job's group), and sharded with
``step_ahead=False`` (the slice step and the weight all-gather at ``step()``,
not during the backward: what taking them during it gains); per round the score
``step / max(compute, communication)`` (1.0: the communication is hidden).
``--sleeping-only`` runs this table alone (``training-sleeping.json``/``.md``).

    python benchmarks/training.py [--rounds 5] [--steps 4] [--methods "prepare + sharded,..."]
        [--models "MLP 21M"]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import _sleeping
import gradhub
from _common import RESULTS, machine_note, rank_zero_result, spread, write_results
from gradhub.collective import all_reduce, local_group
from gradhub.train.strategies import make_strategy

WORLD_SIZE = 2
PER_RANK = 64
MODELS = {
    "MLP 1.9M": [784, 1024, 1024, 10],
    "MLP 21M": [1024, 4096, 4096, 10],
}
PEER = "DDP"
TRANSPORTS = ["shm", "ring"]
OWN_LOOP = ["prepare + allreduce", "prepare + sharded", "prepare + sharded (no overlap)"]
FLOOR = "local step (no communication)"
CONTENDERS = [
    PEER,
    *[f"gradhub {s} ({t})" for s in ("allreduce", "sharded") for t in TRANSPORTS],
    *OWN_LOOP,
    FLOOR,
]
BASELINE = "1 process, 2 threads"
SLEEPING = {  # contender -> the communication row its score divides by
    "DDP (gloo)": "communication (gloo)",
    "prepare + allreduce": "communication (gradhub)",
    "prepare + sharded": "communication (gradhub)",
    "prepare + sharded (step_ahead=False)": "communication (gradhub)",
}
SLEEPING_FLOORS = ["compute (no communication)", "communication (gloo)", "communication (gradhub)"]


def make_mlp(widths: list[int]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def batch(rank: int, n: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(n, width, generator=g), torch.randint(0, 10, (n,), generator=g)


def contenders(
    widths: list[int],
    x: torch.Tensor,
    y: torch.Tensor,
    runtimes: dict[str, gradhub.Runtime],
    ddp_group: Any,
) -> tuple[dict[str, Callable[[], None]], dict[str, nn.Module], list[Any]]:
    base = make_mlp(widths)
    loss_fn = nn.functional.cross_entropy
    steps: dict[str, Callable[[], None]] = {}
    models: dict[str, nn.Module] = {}

    def loop_step(model: Any, opt: torch.optim.Optimizer) -> Callable[[], None]:
        """A plain loop's step: zero_grad, forward, backward, step."""

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()

        return step

    ddp_model = copy.deepcopy(base)
    ddp = nn.parallel.DistributedDataParallel(ddp_model, process_group=ddp_group)
    steps[PEER] = loop_step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01))
    models[PEER] = ddp_model
    strategies: list[Any] = []
    for name, transport in itertools.product(("allreduce", "sharded"), TRANSPORTS):
        model = copy.deepcopy(base)
        strategy = make_strategy(name)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        strategy.setup(model, opt, runtimes[transport])
        strategies.append(strategy)

        def step(model: nn.Module = model, strategy: Any = strategy) -> None:
            strategy.step(lambda: loss_fn(model(x), y), len(x), len(x) * WORLD_SIZE)

        label = f"gradhub {name} ({transport})"
        steps[label], models[label] = step, model
    for label in OWN_LOOP:
        base_copy = copy.deepcopy(base)
        strategy = label.split(" + ")[1].split(" ")[0]
        model, opt = gradhub.prepare(
            base_copy,
            torch.optim.SGD(base_copy.parameters(), lr=0.01),
            strategy=strategy,
            runtime=runtimes["shm"],
            **({"overlap": False} if "no overlap" in label else {}),
        )
        strategies.append(model.strategy)
        steps[label], models[label] = loop_step(model, opt), base_copy
    local = copy.deepcopy(base)
    steps[FLOOR] = loop_step(local, torch.optim.SGD(local.parameters(), lr=0.01))
    models[FLOOR] = local
    return steps, models, strategies


def sleeping_contenders(
    runtime: gradhub.Runtime, ddp_group: Any
) -> tuple[dict[str, Callable[[], None]], list[Any]]:
    base = _sleeping.model()
    x = _sleeping.batch()
    fns: dict[str, Callable[[], None]] = {}
    ddp = nn.parallel.DistributedDataParallel(
        copy.deepcopy(base), process_group=ddp_group, bucket_cap_mb=_sleeping.BUCKET_MB
    )
    fns["DDP (gloo)"] = _sleeping.loop_step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), x)
    strategies = []
    for label in [name for name in SLEEPING if name.startswith("prepare")]:
        net = copy.deepcopy(base)
        model, opt = gradhub.prepare(
            net,
            torch.optim.SGD(net.parameters(), lr=0.01),
            strategy=label.split()[2],
            runtime=runtime,
            bucket_mb=_sleeping.BUCKET_MB,
            **({"step_ahead": False} if "step_ahead=False" in label else {}),
        )
        strategies.append(model.strategy)
        fns[label] = _sleeping.loop_step(model, opt, x)
    local = copy.deepcopy(base)
    fns["compute (no communication)"] = _sleeping.loop_step(
        local, torch.optim.SGD(local.parameters(), lr=0.01), x
    )
    fns["communication (gloo)"] = _sleeping.buckets_reduced(
        lambda b: torch.distributed.all_reduce(b, group=ddp_group, async_op=True)
    )
    fns["communication (gradhub)"] = _sleeping.buckets_reduced(
        lambda b: all_reduce(b, group=runtime.group)
    )
    return fns, strategies


def timed_rounds(
    fns: dict[str, Callable[[], None]], rounds: int, steps: int
) -> tuple[dict[str, list[list[float]]], dict[str, list[float]]]:
    """Every function ``steps`` times per round, the order rotating round by
    round; (wall seconds per step by round, CPU seconds of this process per step)."""
    names = list(fns)
    for name in names:  # warm-up: allocations, gloo pairs
        fns[name]()
        fns[name]()
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            torch.distributed.barrier()
            per_step = []
            for _ in range(steps):
                t0, c0 = time.perf_counter(), time.process_time()
                fns[name]()
                per_step.append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
            times[name].append(per_step)
    return times, cpu


def rank_main(
    rank: int,
    port: int,
    rounds: int,
    steps: int,
    methods: list[str],
    models: list[str],
    sleeping: bool,
    queue: Any,
) -> None:
    torch.set_num_threads(1)
    with local_group(rank, WORLD_SIZE, port, timeout=600):
        runtime = gradhub.init(timeout=600)
        ring = runtime.group.sibling()
        ring.transport = "ring"
        runtimes = {
            "shm": runtime,
            "ring": dataclasses.replace(runtime, group=ring, owns_group=False),
        }
        ddp_group = torch.distributed.new_group(backend="gloo")  # DDP's own
        report: dict[str, Any] = {}
        for label in models:
            widths = MODELS[label]
            x, y = batch(rank, PER_RANK, widths[0])
            fns, nets, strategies = contenders(widths, x, y, runtimes, ddp_group)
            times, cpu = timed_rounds({name: fns[name] for name in methods}, rounds, steps)
            same_steps = [m for m in methods if "allreduce" in m]  # as many steps as DDP
            diff = _max_diff(nets[PEER], nets[same_steps[0]]) if same_steps else math.nan
            params = sum(p.numel() for p in nets[PEER].parameters())
            report[label] = {
                "params": params,
                "times": times,
                "cpu": cpu,
                "ddp_vs_allreduce_max_diff": diff,
            }
            for s in strategies:
                s.close()
        if sleeping:
            fns, strategies = sleeping_contenders(runtime, ddp_group)
            times, _ = timed_rounds(fns, rounds, steps)
            report["sleeping"] = {"times": times}
            for s in strategies:
                s.close()
        ring.close()
        runtime.close()
        if rank == 0:
            queue.put(report)


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(
        float((p.detach() - q.detach()).abs().max())
        for p, q in zip(a.parameters(), b.parameters(), strict=True)
    )


def single_process(rounds: int, steps: int, models: list[str]) -> dict[str, list[list[float]]]:
    torch.set_num_threads(2)
    out: dict[str, list[list[float]]] = {}
    for label in models:
        widths = MODELS[label]
        model = make_mlp(widths)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        xs, ys = zip(*(batch(r, PER_RANK, widths[0]) for r in range(WORLD_SIZE)), strict=True)
        x, y = torch.cat(xs), torch.cat(ys)

        def step(
            model: nn.Module = model,
            opt: torch.optim.Optimizer = opt,
            x: torch.Tensor = x,
            y: torch.Tensor = y,
        ) -> None:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        step()
        step()
        rounds_out = []
        for _ in range(rounds):
            per_step = []
            for _ in range(steps):
                t0 = time.perf_counter()
                step()
                per_step.append(time.perf_counter() - t0)
            rounds_out.append(per_step)
        out[label] = rounds_out
    return out


def summarise(report: dict[str, Any], single: dict[str, list[list[float]]]) -> list[dict[str, Any]]:
    rows = []
    for label, entry in report.items():
        if label == "sleeping":
            continue
        all_times = {**entry["times"], BASELINE: single[label]}
        peer = statistics.median(t for rnd in all_times[PEER] for t in rnd)
        peer_rounds = [statistics.median(rnd) for rnd in all_times[PEER]]
        cpu = {name: statistics.median(c) for name, c in entry.get("cpu", {}).items()}
        for name, rounds in all_times.items():
            flat = [t for rnd in rounds for t in rnd]
            med = statistics.median(flat)
            round_medians = [statistics.median(rnd) for rnd in rounds]
            # Each round runs every contender back to back: the ratio within a
            # round cancels most of the load that other jobs put on the machine.
            per_round = [m / p for m, p in zip(round_medians, peer_rounds, strict=False)]
            paired = statistics.median(per_round)
            rows.append(
                {
                    "model": label,
                    "params": entry["params"],
                    "method": name,
                    "median_step_ms": med * 1e3,
                    "spread_ms": [min(round_medians) * 1e3, max(round_medians) * 1e3],
                    "samples_per_s": PER_RANK * WORLD_SIZE / med,
                    "ratio_to_ddp": med / peer,
                    "paired_ratio_to_ddp": paired if name != BASELINE else math.nan,
                    "paired_spread": [min(per_round), max(per_round)]
                    if name != BASELINE
                    else [math.nan, math.nan],
                    "median_cpu_ms": cpu.get(name, math.nan) * 1e3,
                    "cpu_ratio_to_ddp": cpu.get(name, math.nan) / cpu[PEER] if cpu else math.nan,
                    "ddp_vs_allreduce_max_diff": entry["ddp_vs_allreduce_max_diff"],
                }
            )
    return rows


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _times(ratio: float) -> str:
    return "-" if math.isnan(ratio) else f"{ratio:.2f}x"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | method | median step (ms) | round medians min-max (ms) | samples/s "
        "| vs DDP | vs DDP, per round: median [min, max] | CPU ms/step (rank 0) | CPU vs DDP |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        lo, hi = r["spread_ms"]
        lines.append(
            f"| {r['model']} ({r['params'] / 1e6:.2f}M) | {r['method']} | "
            f"{r['median_step_ms']:.1f} | {lo:.1f}-{hi:.1f} | {r['samples_per_s']:,.0f} | "
            f"{r['ratio_to_ddp']:.2f}x | {_times(r['paired_ratio_to_ddp'])}"
            + (
                ""
                if math.isnan(r["paired_spread"][0])
                else f" [{r['paired_spread'][0]:.2f}, {r['paired_spread'][1]:.2f}]"
            )
            + f" | {_ms(r['median_cpu_ms'])} | {_times(r['cpu_ratio_to_ddp'])} |"
        )
    return "\n".join(lines)


def sleeping_rows(times: dict[str, list[list[float]]]) -> list[dict[str, Any]]:
    """Per contender: median step, and the per-round score against its floors."""
    medians = {name: [statistics.median(r) for r in rounds] for name, rounds in times.items()}
    scores = _sleeping.scores(medians, "compute (no communication)", SLEEPING)
    rows = []
    for name, per_round in medians.items():
        row: dict[str, Any] = {"method": name, "step_ms": spread([t * 1e3 for t in per_round])}
        if name in scores:
            row["score"] = spread(scores[name])
            ddp = scores["DDP (gloo)"]
            row["score_minus_ddp"] = spread([a - b for a, b in zip(scores[name], ddp, strict=True)])
        rows.append(row)
    return rows


def sleeping_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| method | step (ms): median [min, max] of rounds | score: step / max(compute, "
        "communication), median [min, max] | score minus DDP's, same round |",
        "| --- | --- | --- | --- |",
    ]

    def cell(v: dict[str, float] | None, fmt: str) -> str:
        return "-" if v is None else f"{v['median']:{fmt}} [{v['min']:{fmt}}, {v['max']:{fmt}}]"

    for r in rows:
        lines.append(
            f"| {r['method']} | {cell(r['step_ms'], '.1f')} | {cell(r.get('score'), '.2f')} "
            f"| {cell(r.get('score_minus_ddp'), '+.2f')} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument(
        "--methods",
        default=",".join(CONTENDERS),
        help=f"comma-separated contenders to time (DDP always): {', '.join(CONTENDERS)}",
    )
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated: {', '.join(MODELS)}"
    )
    parser.add_argument(
        "--sleeping-only", action="store_true", help="only the sleeping-backward table"
    )
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("--rounds must be at least 5")
    models = [] if args.sleeping_only else [m for m in args.models.split(",") if m]
    if any(m not in MODELS for m in models):
        parser.error(f"unknown model(s) in {models}; choose from {list(MODELS)}")
    methods = [PEER] + [m for m in args.methods.split(",") if m and m != PEER]
    unknown = [m for m in methods if m not in CONTENDERS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {CONTENDERS}")
    before = machine_note()
    report = rank_zero_result(rank_main, WORLD_SIZE, args.rounds, args.steps, methods, models, True)
    single = single_process(args.rounds, args.steps, models)
    after = os.getloadavg()
    rows = summarise(report, single)
    table = markdown(rows) if rows else "(MLP rows not run)"
    asleep = sleeping_rows(report["sleeping"]["times"])
    meta = {
        "machine": platform.platform(),
        "cpus": torch.get_num_threads(),
        "torch": torch.__version__,
        "world_size": WORLD_SIZE,
        "per_rank_batch": PER_RANK,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "note": "2 ranks on a 2-core machine fill both cores; 1 intra-op thread per rank",
        "copy_bandwidth": before,
        "loadavg_after": list(after),
    }
    diffs = {r["model"]: r["ddp_vs_allreduce_max_diff"] for r in rows}
    note = ", ".join(f"{m}: {d:.1e}" for m, d in diffs.items())
    text = (
        f"{args.rounds} alternating rounds of {args.steps} steps; one-thread copy "
        f"{before['copy_GBps_median']:.1f} GB/s; load average {before['loadavg'][0]:.2f} "
        f"before, {after[0]:.2f} after.\n\n{table}\n\n"
        f"max |DDP - gradhub allreduce| parameter difference at the end: {note}\n"
    )
    text += (
        f"\nA backward that leaves the CPU idle ({_sleeping.BLOCKS} blocks of "
        f"{_sleeping.NUMEL * 4 >> 20} MB, {_sleeping.SLEEP * 1e3:.0f} ms of sleep each, one "
        f"bucket per block), {args.rounds} rounds of {args.steps} steps:\n\n"
        f"{sleeping_markdown(asleep)}\n"
    )
    report_out = {"meta": meta, "rows": rows, "sleeping": asleep}
    name = "training-sleeping" if args.sleeping_only else "training"
    write_results(args.out, name, report_out, text)
    print(text)


if __name__ == "__main__":
    main()
