"""gradhub reduce-scatter + all-gather beside gloo's own collectives, 2 ranks.

Two processes on 127.0.0.1 (gloo). For each size (fp32 elements), the methods
below run alternating in one run (the order rotates every round), each timed
as the slower rank's time from a common barrier:

- ``ring ...`` / ``shm ...``: the same gradhub call on a group whose transport
  is the gloo ring (:mod:`gradhub.transports.p2p_ring`) or shared memory
  (:mod:`gradhub.transports.shm`), side by side:
  - ``RS+AG fp32``: :func:`gradhub.collective.reduce_scatter` then
    :func:`gradhub.collective.all_gather`, codec ``"none"``, into separate outputs;
  - ``RS+AG fp32 in place``: the reduce-scatter writes the input's own slice and
    the all-gather writes over the input (an in-place all-reduce);
    ``, shared vector``: the same calls on a vector made by
    :meth:`~gradhub.transports.shm.ShmTransport.shared_vector` (shared memory
    only), which the other rank reads in place: what a caller that keeps its
    buffers in shared memory (``AllReduceParameter``) gets;
  - ``RS+AG bf16``: out of place with ``"bf16"`` on the wire;
  - ``AllReduceParameter cycle``: ``put_gradients(x)``,
    ``aggregate_gradient_partition(1)``, ``send_weight_partition``,
    ``get_weights(w).wait()`` with plain tensors (the gradient is copied in,
    the weights gathered out);
  - ``AllReduceParameter cycle, bound``: the same calls given the flat
    buffers a bound model's parameters and grads are views of
    (``flat_gradients`` holds the gradient, ``get_weights(flat_weights)``):
    the zero-copy cycle.
- ``user ...``: the two cycles on ``AllReduceParameter(n)`` of the user's own
  ``dist.init_process_group("gloo")`` (group=None: the transport gradhub picks).
- ``gloo all_reduce``: ``torch.distributed.all_reduce``, the baseline.
- ``gloo RS+AG``: gloo's ``reduce_scatter_single`` + ``all_gather_single``
  (``reduce_scatter_tensor``/``all_gather_into_tensor`` before torch 2.13).
- ``p2p floor``: two plain ``isend``/``irecv`` exchanges of half the vector
  each way, no arithmetic: what the wire alone costs for RS+AG on gloo.

Floors, from this machine's one-thread copy bandwidth C (bytes copied per
second, measured at the start and recorded; a copy of b bytes reads b and
writes b, so the floor is the bytes each rank reads and writes / 2C): with h
the bytes of half the vector, an in-place RS+AG of private tensors through
shared memory must, per rank, copy its other half into shared memory (h),
add the peer's copy of its own half to its own (read 2h, write h: 1.5 h of
copying), publish that sum (h) and copy the peer's sum out (h): 4.5 h / C.
``AllReduceParameter``'s flat buffers live in shared memory
(:meth:`gradhub.transports.shm.ShmTransport.shared_vector`), so the bound
cycle only adds the peer's half to its own where they lie (1.5 h) and copies
the peer's slice of the weights out (h): 2.5 h / C. The copying cycle adds
the gradient copy in (2h), the published snapshot (h), and an all-gather
into the caller's private tensor (3h, as in place): 7.5 h / C. C is measured
on 64 MB copies (twice the last-level cache); at 4M floats part of the
traffic stays in the 32 MB cache, so a time somewhat under the floor is
possible there.

Bus bandwidth per nccl-tests: algbw = 4 * n bytes / time, and for all-reduce
(and reduce-scatter + all-gather, which move the same bytes)
busbw = algbw * 2(P-1)/P; with P = 2 ranks busbw = algbw. Reports the median
over rounds, min-max spread, and the ratio of median times to gloo
all_reduce (< 1: faster). Writes ``collectives.json`` and ``collectives.md``
to ``--out`` and prints the table.

    python benchmarks/collectives.py [--rounds 9] [--sizes 1024 4194304 ...]

Also records the load average before and after the run.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import RESULTS, machine_note, rank_zero_result, write_results
from gradhub.collective import (
    AllReduceParameter,
    CollectiveGroup,
    all_gather,
    reduce_scatter,
)
from gradhub.collective.collectives import run_shared_vectors
from gradhub.partition import partition_range

WORLD_SIZE = 2
SIZES = [1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 25_000_000]
BASELINE = "gloo all_reduce"
TRANSPORTS = ["ring", "shm"]
CYCLES = ["AllReduceParameter cycle", "AllReduceParameter cycle, bound"]
OURS = ["RS+AG fp32", "RS+AG fp32 in place", "RS+AG bf16", *CYCLES]
SHARED = "shm RS+AG fp32 in place, shared vector"
METHODS = [
    *(f"{t} {m}" for m in OURS for t in TRANSPORTS),
    SHARED,
    *(f"user {m}" for m in CYCLES),
    BASELINE,
    "gloo RS+AG",
    "p2p floor",
]
FLOOR_HALVES = {"RS+AG fp32 in place": 4.5, "AllReduceParameter cycle, bound": 2.5}
FLOOR_HALVES["RS+AG fp32 in place, shared vector"] = 2.5
FLOOR_HALVES["AllReduceParameter cycle"] = 7.5

_rs_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ag_native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


Method = Callable[[torch.Tensor], None]


def cycles(
    parameter: AllReduceParameter, weights: torch.Tensor
) -> tuple[Method, Method, torch.Tensor]:
    """The copying cycle, the bound one, and the buffer the bound one reduces."""

    def copying(x: torch.Tensor) -> None:
        parameter.put_gradients(x)
        parameter.aggregate_gradient_partition(1)
        parameter.send_weight_partition()
        parameter.get_weights(weights).wait()

    flat_weights, flat_gradients = parameter.flat_weights, parameter.flat_gradients

    def bound(x: torch.Tensor) -> None:
        parameter.put_gradients(flat_gradients)
        parameter.aggregate_gradient_partition(1)
        parameter.send_weight_partition()
        parameter.get_weights(flat_weights).wait()

    return copying, bound, flat_gradients


def make_methods(
    rank: int, n: int, groups: dict[str, CollectiveGroup]
) -> tuple[dict[str, Method], dict[str, torch.Tensor], list[AllReduceParameter]]:
    """The methods by name, the input each reads where it is not ``x``, and
    the parameters to close."""
    start, length = partition_range(n, WORLD_SIZE, rank)
    half = -(-n // WORLD_SIZE)  # gloo's tensor collectives need equal slices
    padded_in = torch.zeros(half * WORLD_SIZE)
    padded_out = torch.empty(half)
    full_out = torch.empty(n)
    own_out = torch.empty(length)
    other = 1 - rank
    inbox = torch.empty(n)
    weights = torch.empty(n)
    methods: dict[str, Method] = {}
    inputs: dict[str, torch.Tensor] = {}
    parameters = []

    for transport, group in groups.items():

        def out_of_place(codec: str, g: CollectiveGroup = group) -> Callable[[torch.Tensor], None]:
            def run(x: torch.Tensor) -> None:
                reduce_scatter(x, group=g, compress=codec, out=own_out)
                all_gather(own_out, n, group=g, compress=codec, out=full_out)

            return run

        def in_place(x: torch.Tensor, g: CollectiveGroup = group) -> None:
            # like all_reduce: the result lands in x itself; the own slice is
            # reduced where it lies, so no partition is copied twice
            mine = x[start : start + length]
            reduce_scatter(x, group=g, out=mine)
            all_gather(mine, n, group=g, out=x)

        methods[f"{transport} RS+AG fp32"] = out_of_place("none")
        methods[f"{transport} RS+AG fp32 in place"] = in_place
        methods[f"{transport} RS+AG bf16"] = out_of_place("bf16")
        if transport == "shm":  # the same in-place calls on a vector in shared memory
            vectors = group.submit(
                "vector", lambda g=group: run_shared_vectors(g, 1, n, name="vector")
            ).wait()
            assert vectors is not None
            vector = vectors[0]
            methods[SHARED] = lambda x, v=vector, g=group: in_place(v, g)
            inputs[SHARED] = vector

    # the cycles: on each transport, and as a user writes it (group=None: the
    # user's own default group, the transport gradhub picks for it)
    for prefix, group_or_none in [*groups.items(), ("user", None)]:
        # two objects: the bound one publishes its master in place
        copying = AllReduceParameter(n, group=group_or_none)
        copying.init(torch.zeros(n))
        bound = AllReduceParameter(n, group=group_or_none)
        bound.init(torch.zeros(n))
        parameters += [copying, bound]
        methods[f"{prefix} AllReduceParameter cycle"] = cycles(copying, weights)[0]
        _, run_bound, buffer = cycles(bound, weights)
        methods[f"{prefix} AllReduceParameter cycle, bound"] = run_bound
        inputs[f"{prefix} AllReduceParameter cycle, bound"] = buffer

    def gloo_all_reduce(x: torch.Tensor) -> None:
        dist.all_reduce(x)

    def gloo_rs_ag(x: torch.Tensor) -> None:
        padded_in[:n].copy_(x)
        _rs_native(padded_out, padded_in)
        _ag_native(padded_in, padded_out)

    def p2p_floor(x: torch.Tensor) -> None:
        o_start, o_length = partition_range(n, WORLD_SIZE, other)
        for _ in range(2):
            send = dist.isend(x[o_start : o_start + o_length], other)
            recv = dist.irecv(inbox[start : start + length], other)
            assert send is not None and recv is not None
            send.wait()
            recv.wait()

    methods[BASELINE] = gloo_all_reduce
    methods["gloo RS+AG"] = gloo_rs_ag
    methods["p2p floor"] = p2p_floor
    return methods, inputs, parameters


def rank_main(rank: int, port: int, sizes: list[int], rounds: int, queue: mp.Queue) -> None:
    warnings.simplefilter("ignore", FutureWarning)  # torch's renamed-collective notices
    torch.set_num_threads(1)
    # the user's own group, as a torch script makes it
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    with (
        CollectiveGroup.of(None, timeout=300, transport="ring") as ring,
        CollectiveGroup.of(None, timeout=300, transport="shm") as shm,
    ):
        groups = {"ring": ring, "shm": shm}
        results: dict[str, dict[str, list[float]]] = {}
        for n in sizes:
            methods, inputs, parameters = make_methods(rank, n, groups)
            source = torch.randn(n, generator=torch.Generator().manual_seed(rank))
            x = source.clone()
            times: dict[str, list[float]] = {m: [] for m in METHODS}
            reps = max(1, min(20, (1 << 22) // max(n, 1)))  # several calls per sample when small
            for name in METHODS:  # warm-up: buffers, connections
                methods[name](inputs.get(name, x))
            for r in range(rounds):
                order = METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]
                for name in order:
                    x.copy_(source)
                    inputs.get(name, x).copy_(source)
                    dist.barrier()
                    begin = time.perf_counter()
                    for _ in range(reps):
                        methods[name](x)
                    elapsed = torch.tensor([(time.perf_counter() - begin) / reps])
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    times[name].append(float(elapsed))
            results[str(n)] = times
            for parameter in parameters:
                parameter.close()
        if rank == 0:
            queue.put(results)
    dist.destroy_process_group()


def summarise(raw: dict[str, dict[str, list[float]]], copy_gbps: float) -> list[dict[str, object]]:
    """Per size and method: median, spread, bandwidth, ratio to gloo all_reduce
    (of the medians, and median and min-max of the per-round ratios), and
    the floor (see the module docstring) where one is stated."""
    rows = []
    factor = 2 * (WORLD_SIZE - 1) / WORLD_SIZE
    for n_text, times in raw.items():
        n = int(n_text)
        base = statistics.median(times[BASELINE])
        for name, samples in times.items():
            med = statistics.median(samples)
            algbw = 4 * n / med / 1e9
            per_round = [t / b for t, b in zip(samples, times[BASELINE], strict=True)]
            # the floors are shared memory's ("user": the transport gradhub picks, shm here)
            shm = name.startswith(("shm ", "user "))
            halves = next((h for m, h in FLOOR_HALVES.items() if shm and name.endswith(m)), None)
            floor = None if halves is None else halves * 2 * n / (copy_gbps * 1e9)
            rows.append(
                {
                    "elements": n,
                    "method": name,
                    "median_ms": med * 1e3,
                    "min_ms": min(samples) * 1e3,
                    "max_ms": max(samples) * 1e3,
                    "algbw_GBps": algbw,
                    "busbw_GBps": algbw * factor,
                    "ratio_to_all_reduce": med / base,
                    "round_ratios": {
                        "median": statistics.median(per_round),
                        "min": min(per_round),
                        "max": max(per_round),
                    },
                    "floor_ms": None if floor is None else floor * 1e3,
                    "samples": len(samples),
                }
            )
    return rows


GOALS = [
    ("user AllReduceParameter cycle, bound", BASELINE, "<= 0.6 from 4M"),
    ("user AllReduceParameter cycle, bound", "shm RS+AG fp32 in place", "<= 1.1"),
    ("user AllReduceParameter cycle", BASELINE, ""),
    ("shm RS+AG fp32 in place", BASELINE, "<= 0.45 or 1.3x floor"),
    (SHARED, BASELINE, ""),
]


def goals(raw: dict[str, dict[str, list[float]]]) -> list[dict[str, object]]:
    """Ratios of times taken in the same rounds: median and min-max over rounds."""
    out = []
    for n_text, times in raw.items():
        for num, den, goal in GOALS:
            ratios = [a / b for a, b in zip(times[num], times[den], strict=True)]
            out.append(
                {
                    "elements": int(n_text),
                    "figure": f"{num} / {den}",
                    "goal": goal,
                    "median": statistics.median(ratios),
                    "min": min(ratios),
                    "max": max(ratios),
                    # the fastest samples are the least disturbed by other load
                    "fastest": min(times[num]) / min(times[den]),
                }
            )
    return out


def markdown(rows: list[dict[str, object]], goal_rows: list[dict[str, object]], note: str) -> str:
    lines = [
        note,
        "",
        "| elements | method | median ms | spread ms | floor ms | busbw GB/s "
        "| time / gloo all_reduce | per round: median [min, max] |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for row in rows:
        rr = row["round_ratios"]
        assert isinstance(rr, dict)
        floor = row["floor_ms"]
        lines.append(
            f"| {row['elements']:,} | {row['method']} | {row['median_ms']:.3f} | "
            f"{row['min_ms']:.3f}-{row['max_ms']:.3f} | "
            f"{'' if floor is None else f'{floor:.2f}'} | {row['busbw_GBps']:.2f} | "
            f"{row['ratio_to_all_reduce']:.2f} | "
            f"{rr['median']:.2f} [{rr['min']:.2f}, {rr['max']:.2f}] |"
        )
    lines += [
        "",
        "Ratios of times taken in the same rounds (median [min, max] over rounds), and "
        "of the fastest samples (the least disturbed by other load):",
        "",
        "| elements | figure | goal | measured | fastest / fastest |",
        "| ---: | --- | --- | --- | ---: |",
    ]
    for g in goal_rows:
        lines.append(
            f"| {g['elements']:,} | {g['figure']} | {g['goal']} | "
            f"{g['median']:.2f} [{g['min']:.2f}, {g['max']:.2f}] | {g['fastest']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=SIZES)
    parser.add_argument("--rounds", type=int, default=9, help="alternation rounds per size")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("--rounds must be at least 5")

    before = machine_note()
    raw = rank_zero_result(rank_main, WORLD_SIZE, args.sizes, args.rounds)
    after = os.getloadavg()
    rows = summarise(raw, before["copy_GBps_median"])
    goal_rows = goals(raw)
    note = (
        f"2 ranks, gloo on 127.0.0.1, torch {torch.__version__}, {args.rounds} alternating "
        f"rounds; one-thread copy {before['copy_GBps_median']:.1f} GB/s "
        f"[{before['copy_GBps_min']:.1f}, {before['copy_GBps_max']:.1f}]; load average "
        f"{before['loadavg'][0]:.2f} before, {after[0]:.2f} after."
    )
    table = markdown(rows, goal_rows, note)
    report = {
        "benchmark": "collectives",
        "world_size": WORLD_SIZE,
        "backend": "gloo",
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads in the parent",
        "copy_bandwidth": before,
        "loadavg_after": list(after),
        "rounds": args.rounds,
        "rows": rows,
        "goals": goal_rows,
    }
    write_results(args.out, "collectives", report, table + "\n")
    print(table)


if __name__ == "__main__":
    main()
