"""gradhub reduce-scatter + all-gather beside gloo's own collectives, 2 ranks.

Two processes on 127.0.0.1 (gloo). For each size (fp32 elements), the methods
below run alternating in one run (the order rotates every round), each timed
as the slower rank's time from a common barrier:

- ``ring ...`` / ``shm ...``: the same gradhub call on a group whose transport
  is the gloo ring (:mod:`gradhub.collective.ring`) or shared memory
  (:mod:`gradhub.transports.shm`), side by side:
  - ``RS+AG fp32``: :func:`gradhub.collective.reduce_scatter` then
    :func:`gradhub.collective.all_gather`, codec ``"none"``, into separate outputs;
  - ``RS+AG fp32 in place``: the reduce-scatter writes the input's own slice and
    the all-gather writes over the input (an in-place all-reduce);
  - ``RS+AG bf16``: out of place with ``"bf16"`` on the wire;
  - ``AllReduceParameter cycle``: ``put_gradients``,
    ``aggregate_gradient_partition``, ``send_weight_partition``, ``get_weights``.
- ``gloo all_reduce``: ``torch.distributed.all_reduce``, the baseline.
- ``gloo RS+AG``: gloo's ``reduce_scatter_single`` + ``all_gather_single``
  (``reduce_scatter_tensor``/``all_gather_into_tensor`` before torch 2.13).
- ``p2p floor``: two plain ``isend``/``irecv`` exchanges of half the vector
  each way, no arithmetic: what the wire alone costs for RS+AG on gloo.

Bus bandwidth per nccl-tests: algbw = 4 * n bytes / time, and for all-reduce
(and reduce-scatter + all-gather, which move the same bytes)
busbw = algbw * 2(P-1)/P; with P = 2 ranks busbw = algbw. Reports the median
over rounds, min-max spread, and the ratio of median times to gloo
all_reduce (< 1: faster). Writes ``collectives.json`` and ``collectives.md``
to ``--out`` and prints the table.

    python benchmarks/collectives.py [--rounds 9] [--sizes 1024 4194304 ...]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import RESULTS, rank_zero_result, write_results
from gradhub.collective import (
    AllReduceParameter,
    CollectiveGroup,
    all_gather,
    local_group,
    reduce_scatter,
)
from gradhub.partition import partition_range

WORLD_SIZE = 2
SIZES = [1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24, 25_000_000]
BASELINE = "gloo all_reduce"
TRANSPORTS = ["ring", "shm"]
OURS = ["RS+AG fp32", "RS+AG fp32 in place", "RS+AG bf16", "AllReduceParameter cycle"]
METHODS = [
    *(f"{t} {m}" for m in OURS for t in TRANSPORTS),
    BASELINE,
    "gloo RS+AG",
    "p2p floor",
]

_rs_native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ag_native = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def make_methods(
    rank: int, n: int, groups: dict[str, CollectiveGroup]
) -> dict[str, Callable[[torch.Tensor], None]]:
    start, length = partition_range(n, WORLD_SIZE, rank)
    half = -(-n // WORLD_SIZE)  # gloo's tensor collectives need equal slices
    padded_in = torch.zeros(half * WORLD_SIZE)
    padded_out = torch.empty(half)
    full_out = torch.empty(n)
    own_out = torch.empty(length)
    other = 1 - rank
    inbox = torch.empty(n)
    weights = torch.empty(n)
    methods: dict[str, Callable[[torch.Tensor], None]] = {}

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

        parameter = AllReduceParameter(n, group=group)
        parameter.init(torch.zeros(n))

        def cycle(x: torch.Tensor, p: AllReduceParameter = parameter) -> None:
            p.put_gradients(x)
            p.aggregate_gradient_partition(1)
            p.send_weight_partition()
            p.get_weights(weights).wait()

        methods[f"{transport} RS+AG fp32"] = out_of_place("none")
        methods[f"{transport} RS+AG fp32 in place"] = in_place
        methods[f"{transport} RS+AG bf16"] = out_of_place("bf16")
        methods[f"{transport} AllReduceParameter cycle"] = cycle

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
    return methods


def rank_main(rank: int, port: int, sizes: list[int], rounds: int, queue: mp.Queue) -> None:
    warnings.simplefilter("ignore", FutureWarning)  # torch's renamed-collective notices
    torch.set_num_threads(1)
    with local_group(rank, WORLD_SIZE, port, timeout=300, transport="ring") as ring:
        shm = ring.sibling()  # same process group, its own counters and transport
        shm.transport = "shm"
        groups = {"ring": ring, "shm": shm}
        results: dict[str, dict[str, list[float]]] = {}
        for n in sizes:
            methods = make_methods(rank, n, groups)
            source = torch.randn(n, generator=torch.Generator().manual_seed(rank))
            x = source.clone()
            times: dict[str, list[float]] = {m: [] for m in METHODS}
            reps = max(1, min(20, (1 << 22) // max(n, 1)))  # several calls per sample when small
            for name in METHODS:  # warm-up: buffers, connections
                methods[name](x)
            for r in range(rounds):
                order = METHODS[r % len(METHODS) :] + METHODS[: r % len(METHODS)]
                for name in order:
                    x.copy_(source)
                    dist.barrier()
                    begin = time.perf_counter()
                    for _ in range(reps):
                        methods[name](x)
                    elapsed = torch.tensor([(time.perf_counter() - begin) / reps])
                    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                    times[name].append(float(elapsed))
            results[str(n)] = times
        shm.close()
        if rank == 0:
            queue.put(results)


def summarise(raw: dict[str, dict[str, list[float]]]) -> list[dict[str, object]]:
    rows = []
    factor = 2 * (WORLD_SIZE - 1) / WORLD_SIZE
    for n_text, times in raw.items():
        n = int(n_text)
        base = statistics.median(times[BASELINE])
        for name, samples in times.items():
            med = statistics.median(samples)
            algbw = 4 * n / med / 1e9
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
                    "samples": len(samples),
                }
            )
    return rows


def markdown(rows: list[dict[str, object]]) -> str:
    lines = [
        "| elements | method | median ms | spread ms | busbw GB/s | time / gloo all_reduce |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['elements']:,} | {row['method']} | {row['median_ms']:.3f} | "
            f"{row['min_ms']:.3f}-{row['max_ms']:.3f} | {row['busbw_GBps']:.2f} | "
            f"{row['ratio_to_all_reduce']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=SIZES)
    parser.add_argument("--rounds", type=int, default=9, help="alternation rounds per size")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()

    raw = rank_zero_result(rank_main, WORLD_SIZE, args.sizes, args.rounds)
    rows = summarise(raw)
    table = markdown(rows)
    report = {
        "benchmark": "collectives",
        "world_size": WORLD_SIZE,
        "backend": "gloo",
        "torch": torch.__version__,
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads in the parent",
        "rounds": args.rounds,
        "rows": rows,
    }
    write_results(args.out, "collectives", report, table + "\n")
    print(table)


if __name__ == "__main__":
    main()
