"""The "gradhub" torch.distributed backend against gloo and DeepSpeed: all-reduce, DDP, FSDP2.

Two ranks on this host, every backend in the same processes (the default group
is "gradhub", a gloo group is made beside it), alternating which goes first in
every round. Per round and backend: the median time of ``--reps`` calls of
``dist.all_reduce`` on 64K, 256K, 1M, 4M and 16M fp32 elements; a DDP training step
(forward, backward with DDP's bucketed all-reduces, SGD step) of a
1024-4096-4096-10 MLP (about 21M parameters, batch 32); and the same step with
FSDP2's ``fully_shard`` on a mesh of the group. Reported: the median over the
rounds, min and max, and the ratio gradhub / gloo per round (its median and
spread); for the steps also the CPU seconds rank 0's process spent per step
(every thread, kernel included): the work, which load from other jobs on the
machine inflates far less than the wall time. This machine's one-thread copy
bandwidth and load are recorded.
Goals: all-reduce <= 0.5x gloo from 4M elements up, and at or below
DeepSpeed's from 64K up; DDP step <= 0.8x.

bf16 rows: ``dist.all_reduce`` of bf16 tensors of the same sizes, timed the
same way beside gloo's bf16 all-reduce (gradhub sums in fp32 and rounds once;
gloo adds in fp32 and rounds after every addition: with two ranks, the same bits).
``--rows all_reduce --merge`` times the all-reduces only and keeps the
recorded rows it does not time, except the all-reduce rows of the dtypes it
times (the table says which rows came from which run); ``--sizes`` (elements,
``K`` = 2**10, ``M`` = 2**20) and ``--dtypes`` pick them.

DeepSpeed (the ``bench`` extra): the all-reduce rows also time
``deepspeed.comm.inference_all_reduce`` on the gloo group, its CPU
shared-memory op (:mod:`_deepspeed`; built at the first run, about a minute),
in the same rounds, the three in turn; per round the ratios DeepSpeed / gloo
and gradhub / DeepSpeed. Every process runs one thread (``OMP_NUM_THREADS=1``:
DeepSpeed's kernels would otherwise use OpenMP threads, gradhub's and gloo's
one thread per rank). Without DeepSpeed (not installed, its op does not build,
the CPU lacks its instructions) the table says why and those columns are empty.

Floors, timed in the same rounds (both ranks at once, as in the real step,
since they share the cores): ``local step``, the same forward, backward and
SGD step on the plain model, no DDP, no communication; ``DDP step, no
communication``, DDP with a comm hook that returns the bucket as it is (DDP's
own bucket copies, nothing travels). Their ratio to the DDP step on gloo is
the least any backend could reach: a backend adds its all-reduce's CPU work
to the second on a machine whose cores the backward already fills.

    python benchmarks/backend.py --rounds 5
Sleeping rows (``--rows sleeping``, and in ``all``): DDP with 16 MB buckets
on each backend over a model whose backward leaves the CPU idle
(:mod:`_sleeping`: six 16 MB blocks, 10 ms of sleep each, as the host waits
for a GPU), beside the same step with no communication and each backend's
bucket all-reduces alone; per round the score ``step / max(compute,
communication)`` (1.0: communication hidden behind the backward).

    python benchmarks/backend.py --rounds 5
    python benchmarks/backend.py --rounds 5 --rows all_reduce --dtypes bf16 --sizes 1,4 --merge
    python benchmarks/backend.py --rounds 5 --rows sleeping --merge
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import _deepspeed
import _sleeping
import gradhub  # noqa: F401  (registers the backend)
from _common import RESULTS, machine_note, rank_zero_result, spread, write_results

SIZES = "64K,256K,1M,4M,16M"
DTYPES = {"fp32": ("", torch.float32), "bf16": (" bf16", torch.bfloat16)}
"""The all-reduce dtypes (``--dtypes``): each one's row name suffix and dtype."""
BACKENDS = ["gradhub", "gloo"]
PEER = "deepspeed"
"""The third all-reduce peer (all-reduce rows only)."""
FLOORS = ["local step", "DDP step, no communication"]
CPU = "[CPU s of rank 0's process]"


def _elements(size: str) -> int:
    """``64K`` -> 65536, ``4M`` -> 4194304 (a bare number: elements)."""
    shift = {"K": 10, "M": 20}.get(size[-1:].upper(), 0)
    return int(size[:-1] if shift else size) << shift


def _size_name(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K"


def _all_reduce_on(group: Any) -> Callable[[torch.Tensor], Any]:
    return lambda t: dist.all_reduce(t, group=group)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 4096),
        torch.nn.ReLU(),
        torch.nn.Linear(4096, 10),
    )


def _timed(fn: Callable[[], None], reps: int, group: Any) -> float:
    return _timed_cpu(fn, reps, group)[0]


def _timed_cpu(fn: Callable[[], None], reps: int, group: Any) -> tuple[float, float]:
    """Median wall seconds of ``fn`` and median CPU seconds of this process
    (every thread: the backend's, gloo's, the kernel's work for them) meanwhile."""
    fn()  # warm-up (buffers, transports)
    walls, cpus = [], []
    for _ in range(reps):
        dist.barrier(group=group)
        begin, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - begin)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def _stepper(model: torch.nn.Module, rank: int) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 1024, generator=g), torch.randint(0, 10, (32,), generator=g)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def _unchanged(state, bucket):  # type: ignore[no-untyped-def]
    """A DDP comm hook that sends nothing: the bucket as it is. (Unannotated:
    DDP compares the annotations with its classes, and this module's are strings.)"""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def rank_main(
    rank: int,
    port: int,
    rounds: int,
    reps: int,
    steps: int,
    sizes: list[int],
    dtypes: list[str],
    with_steps: bool,
    sleeping: bool,
    queue: Any,
) -> None:
    torch.set_num_threads(1)
    _deepspeed.environment(2, port)
    dist.init_process_group(
        "gradhub",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=600),
    )
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    groups = {"gradhub": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    tensors = {
        f"all_reduce {_size_name(n)}{DTYPES[d][0]}": torch.ones(n, dtype=DTYPES[d][1])
        for d in dtypes
        for n in sizes
    }
    reducers = {b: _all_reduce_on(groups[b]) for b in BACKENDS}
    peer: _deepspeed.AllReduce | None = None
    skipped = "no all-reduce rows"
    if tensors:
        peer, skipped = _deepspeed.setup(groups["gloo"], [DTYPES[d][1] for d in dtypes])
        ready = torch.tensor([peer is not None], dtype=torch.int32)
        dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=groups["gloo"])
        if peer is not None and not ready.item():  # every rank times it, or none
            peer, skipped = None, "deepspeed's shm op is unavailable on another rank"
    if peer is not None:
        reducers[PEER], groups[PEER] = peer, groups["gloo"]
    ddp, fsdp, floors = {}, {}, {}
    if with_steps:
        ddp = {b: _stepper(DDP(_mlp(), process_group=groups[b]), rank) for b in BACKENDS}
        silent = DDP(_mlp(), process_group=groups["gloo"])
        silent.register_comm_hook(None, _unchanged)
        floors = {
            "local step": _stepper(_mlp(), rank),
            "DDP step, no communication": _stepper(silent, rank),
        }
        for b in BACKENDS:
            model = _mlp()
            mesh = DeviceMesh.from_group(groups[b], "cpu")
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            fsdp[b] = _stepper(model, rank)
    asleep: dict[str, Callable[[], None]] = {}
    if sleeping:
        x = _sleeping.batch()
        for b in BACKENDS:
            net = DDP(_sleeping.model(), process_group=groups[b], bucket_cap_mb=_sleeping.BUCKET_MB)
            opt = torch.optim.SGD(net.parameters(), lr=1e-3)
            asleep[f"step {b}"] = _sleeping.loop_step(net, opt, x)
            asleep[f"communication {b}"] = _sleeping.buckets_reduced(
                lambda t, g=groups[b]: dist.all_reduce(t, group=g, async_op=True)
            )
        local = _sleeping.model()
        asleep["compute"] = _sleeping.loop_step(local, torch.optim.SGD(local.parameters()), x)
    samples: dict[str, dict[str, list[float]]] = {}
    sleeping_times: dict[str, list[float]] = {}
    for r in range(rounds):
        order = BACKENDS if r % 2 == 0 else BACKENDS[::-1]
        reducing = list(reducers)[r % len(reducers) :] + list(reducers)[: r % len(reducers)]
        for b in reducing:  # each first in turn
            for key, t in tensors.items():
                seconds = _timed(functools.partial(reducers[b], t), reps, groups[b])
                samples.setdefault(key, {}).setdefault(b, []).append(seconds)
        for b in order:
            g = groups[b]
            for key, table in (("DDP step", ddp), ("FSDP2 step", fsdp)) if with_steps else ():
                seconds, cpu = _timed_cpu(table[b], steps, g)
                samples.setdefault(key, {}).setdefault(b, []).append(seconds)
                samples.setdefault(f"{key} {CPU}", {}).setdefault(b, []).append(cpu)
            for what in ("step", "communication") if sleeping else ():
                seconds = _timed(asleep[f"{what} {b}"], steps, g)
                sleeping_times.setdefault(f"{what} {b}", []).append(seconds)
        if sleeping:
            seconds = _timed(asleep["compute"], steps, groups["gloo"])
            sleeping_times.setdefault("compute", []).append(seconds)
        for key, fn in floors.items():  # between the backends, alternating with them
            seconds, cpu = _timed_cpu(fn, steps, groups["gloo"])
            samples.setdefault("DDP step", {}).setdefault(key, []).append(seconds)
            samples.setdefault(f"DDP step {CPU}", {}).setdefault(key, []).append(cpu)
    dist.barrier(group=groups["gloo"])
    _deepspeed.remove_files(rank)
    if rank == 0:
        queue.put((samples, sleeping_times, skipped))
    dist.destroy_process_group()


def _sleeping_rows(times: dict[str, list[float]]) -> dict[str, Any]:
    """Per backend: its DDP step's score against max(compute, its communication)."""
    links = {f"step {b}": f"communication {b}" for b in BACKENDS}
    scores = _sleeping.scores(times, "compute", links)
    rows: dict[str, Any] = {name: {"s": spread(t)} for name, t in times.items()}
    for name, per_round in scores.items():
        rows[name]["score"] = spread(per_round)
    gap = [a - b for a, b in zip(scores["step gradhub"], scores["step gloo"], strict=True)]
    rows["step gradhub"]["score_minus_gloo"] = spread(gap)
    return rows


def _per_round(a: list[float], b: list[float]) -> dict[str, float]:
    return spread([x / y for x, y in zip(a, b, strict=True)])


def _report(
    samples: dict[str, dict[str, list[float]]], rounds: int, skipped: str
) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for key, by_backend in samples.items():
        gloo = by_backend["gloo"]
        rows[key] = {
            "gradhub_s": spread(by_backend["gradhub"]),
            "gloo_s": spread(gloo),
            "ratio": _per_round(by_backend["gradhub"], gloo),
        }
        if PEER in by_backend:
            rows[key][f"{PEER}_s"] = spread(by_backend[PEER])
            rows[key][f"{PEER}_ratio"] = _per_round(by_backend[PEER], gloo)
            rows[key][f"gradhub_vs_{PEER}"] = _per_round(by_backend["gradhub"], by_backend[PEER])
        for floor in FLOORS:
            if floor in by_backend:
                per_round = [a / b for a, b in zip(by_backend[floor], gloo, strict=True)]
                rows[key][floor] = {"s": spread(by_backend[floor]), "ratio": spread(per_round)}
    report = {"rounds": rounds, "world_size": 2, "machine": machine_note(), "rows": rows}
    if any(k.startswith("all_reduce") for k in rows):
        report[PEER] = _deepspeed.version() if not skipped else {"skipped": skipped}
    return report


def _merged(report: dict[str, Any], recorded: Path) -> dict[str, Any]:
    """The recorded report with this run's rows in place of its own, and this run
    listed among the partial runs (rows, rounds, machine) the table names."""
    if not recorded.exists():
        return report
    old = json.loads(recorded.read_text())
    timed = {_dtype_of(k) for k in report["rows"] if k.startswith("all_reduce")}
    kept = {
        k: v
        for k, v in old["rows"].items()
        if not (k.startswith("all_reduce") and _dtype_of(k) in timed)
    }
    partial = [
        {**p, "rows": [k for k in p["rows"] if k in kept and k not in report["rows"]]}
        for p in old.get("partial_runs", [])
    ]
    partial = [p for p in partial if p["rows"]]
    run = {k: report[k] for k in ("rounds", "machine")}
    if PEER in report:
        run[PEER] = report[PEER]
    merged = {
        **old,
        "rows": {**kept, **report["rows"]},
        "partial_runs": [*partial, {"rows": list(report["rows"]), **run}]
        if report["rows"]
        else partial,
    }
    if PEER in report:
        merged[PEER] = report[PEER]
    if "sleeping" in report:  # the sleeping rows, and the run they came from
        merged["sleeping"], merged["sleeping_run"] = report["sleeping"], run
    return merged


def _ratio(r: dict[str, float] | None) -> str:
    return f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]" if r else "-"


def _dtype_of(key: str) -> str:
    """The dtype of an all-reduce row (``all_reduce 4M bf16`` -> ``bf16``)."""
    return next((d for d, (suffix, _) in DTYPES.items() if suffix and key.endswith(suffix)), "fp32")


def _markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    peer = report.get(PEER)
    lines = [
        "# gradhub backend vs gloo and DeepSpeed (2 ranks, one host)",
        "",
        f"{report['rounds']} rounds, alternating. Copy bandwidth (1 thread): "
        f"{m['copy_GBps_median']:.1f} GB/s; load average {m['loadavg']}.",
        "",
        "DeepSpeed: "
        + (
            "not timed: " + peer["skipped"]
            if peer and "skipped" in peer
            else f"deepspeed {peer['version']}, `inference_all_reduce` (CPU shared-memory op), "
            "one OpenMP thread"
            if peer
            else "not timed in these runs"
        )
        + ". Ratios per round; median [min-max].",
        "",
        "| operation | gradhub (median s) | gloo (median s) | gradhub / gloo "
        "| DeepSpeed (median s) | DeepSpeed / gloo | gradhub / DeepSpeed |",
        "|---|---|---|---|---|---|---|",
    ]
    partial = report.get("partial_runs", [])
    marks = {key: "*" * (i + 1) for i, run in enumerate(partial) for key in run["rows"]}
    rows = report["rows"]
    for key in sorted(rows, key=lambda k: not k.startswith("all_reduce")):  # stable
        row = rows[key]
        cells = [f"{row['gradhub_s']['median']:.5f}", f"{row['gloo_s']['median']:.5f}"]
        cells.append(_ratio(row["ratio"]))
        ds = row.get(f"{PEER}_s")
        cells.append(f"{ds['median']:.5f}" if ds else "-")
        cells += [_ratio(row.get(f"{PEER}_ratio")), _ratio(row.get(f"gradhub_vs_{PEER}"))]
        lines.append(f"| {key}{marks.get(key, '')} | " + " | ".join(cells) + " |")
    for i, run in enumerate(partial):
        machine = run["machine"]
        lines += [
            "",
            f"Rows marked {'*' * (i + 1)}: a separate run of these rows only, "
            f"{run['rounds']} rounds, copy bandwidth {machine['copy_GBps_median']:.1f} GB/s, "
            f"load average {machine['loadavg']}.",
        ]
    step = report["rows"].get("DDP step", {})
    cpu = report["rows"].get(f"DDP step {CPU}", {})
    floors = [(f, step[f]) for f in FLOORS if f in step]
    floors += [(f"{f} {CPU}", cpu[f]) for f in FLOORS if f in cpu]
    if floors:
        lines += [
            "",
            "Floors of the DDP step (no backend communicates; both ranks at once), "
            "per round against the DDP step on gloo:",
            "",
            "| floor | median s | ratio to gloo's DDP step median | min-max |",
            "|---|---|---|---|",
        ]
        for name, f in floors:
            r = f["ratio"]
            lines.append(
                f"| {name} | {f['s']['median']:.4f} | {r['median']:.2f}x "
                f"| {r['min']:.2f}-{r['max']:.2f}x |"
            )
    asleep = report.get("sleeping", {})
    if asleep:
        lines += [
            "",
            f"DDP over a backward that leaves the CPU idle ({_sleeping.BLOCKS} blocks of "
            f"{_sleeping.NUMEL * 4 >> 20} MB, {_sleeping.SLEEP * 1e3:.0f} ms of sleep each, "
            "one bucket per block); score = step / max(compute, that backend's "
            "communication), per round"
            + (
                f" (a separate run: {report['sleeping_run']['rounds']} rounds, copy "
                f"{report['sleeping_run']['machine']['copy_GBps_median']:.1f} GB/s, load "
                f"average {report['sleeping_run']['machine']['loadavg']})"
                if "sleeping_run" in report
                else ""
            )
            + ":",
            "",
            "| row | median s [min, max] | score median [min, max] | score minus gloo's |",
            "|---|---|---|---|",
        ]
        for name, row in asleep.items():
            cells = [
                f"{v['median']:{fmt}} [{v['min']:{fmt}}, {v['max']:{fmt}}]" if v else "-"
                for v, fmt in (
                    (row["s"], ".4f"),
                    (row.get("score"), ".2f"),
                    (row.get("score_minus_gloo"), "+.2f"),
                )
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Goals: all-reduce <= 0.5x gloo from 4M up and <= 1.0x DeepSpeed from 64K up; "
        "DDP step <= 0.8x.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5, help="timed all-reduces per round")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round")
    parser.add_argument(
        "--sizes", default=SIZES, help="all-reduce sizes in elements (64K = 2**16, 1M = 2**20)"
    )
    parser.add_argument("--dtypes", default="fp32,bf16", help="all-reduce dtypes: fp32, bf16")
    parser.add_argument(
        "--rows",
        choices=["all", "all_reduce", "sleeping"],
        default="all",
        help="all_reduce: no steps; sleeping: the sleeping-backward rows alone",
    )
    parser.add_argument(
        "--merge", action="store_true", help="keep the recorded rows this run does not time"
    )
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = [_elements(m) for m in args.sizes.split(",")]
    dtypes = args.dtypes.split(",")
    unknown = set(dtypes) - set(DTYPES)
    if unknown:
        parser.error(f"--dtypes: unknown {', '.join(sorted(unknown))}; choose from fp32, bf16")
    with_steps = args.rows == "all"
    sleeping = args.rows in ("all", "sleeping")
    if args.rows == "sleeping":
        sizes = []
    samples, sleeping_times, skipped = rank_zero_result(
        rank_main, 2, args.rounds, args.reps, args.steps, sizes, dtypes, with_steps, sleeping
    )
    if skipped and sizes:
        print(f"DeepSpeed rows skipped: {skipped}")
    report = _report(samples, args.rounds, skipped)
    if sleeping:
        report["sleeping"] = _sleeping_rows(sleeping_times)
    if args.merge:
        report = _merged(report, Path(args.out) / "backend.json")
    write_results(args.out, "backend", report, _markdown(report))
    print(_markdown(report))


if __name__ == "__main__":
    main()
