"""The work per small parameter-server message on each side: CPU time per
4-byte push of gradhub's client and server processes beside a raw pyzmq
DEALER/ROUTER echo's (the floor for a small message).

The same client and server set-ups as ``parameter_server.py`` (``Gradhub``:
the default client of a server process on this host; ``ZmqEcho``: a DEALER
here, a ROUTER echo in another process). Per round, each system sends
``--pushes`` synchronous 4-byte pushes, alternating; measured per push: the
CPU time of this (client) process with all its threads (ZeroMQ's I/O thread
and gradhub's client thread included), the CPU time of the server process
(from ``/proc``), and the wall-clock p50. CPU time is less disturbed by
other load than wall time, which is why it is the figure to cut.

Writes ``ps_message_cost.json`` and ``.md`` to ``--out`` (default
``benchmarks/results``), with the one-thread copy bandwidth and the load
average.

    .venv/bin/python benchmarks/ps_message_cost.py [--rounds 5] [--pushes 3000]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _common import RESULTS, machine_note, spread, write_results
from parameter_server import Gradhub, ZmqEcho


def _process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _round(push: Callable[[], None], server_pid: int, n: int) -> dict[str, float]:
    for _ in range(n // 10):  # warm-up
        push()
    client, server = _own_cpu(), _process_cpu(server_pid)
    latencies = []
    for _ in range(n):
        start = time.perf_counter()
        push()
        latencies.append(time.perf_counter() - start)
    return {
        "client_cpu_us": (_own_cpu() - client) / n * 1e6,
        "server_cpu_us": (_process_cpu(server_pid) - server) / n * 1e6,
        "p50_us": statistics.median(latencies) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pushes", type=int, default=3000, help="pushes per system per round")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("--rounds must be at least 5")
    torch.set_num_threads(1)
    note = machine_note()
    gradhub, echo = Gradhub(), ZmqEcho()
    grad = torch.randn(1)
    gradhub.init("k", torch.zeros(1))
    systems: dict[str, tuple[Callable[[], None], int]] = {
        "gradhub": (lambda: gradhub.push("k", grad), gradhub.server.pid),
        "raw zmq echo": (lambda: echo.push("k", grad), echo.proc.pid),
    }
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in systems}
    try:
        for r in range(args.rounds):
            for name in list(systems)[r % 2 :] + list(systems)[: r % 2]:
                push, pid = systems[name]
                rounds[name].append(_round(push, pid, args.pushes))
    finally:
        gradhub.close()
        echo.close()
    after = os.getloadavg()
    rows: dict[str, Any] = {
        name: {k: spread([r[k] for r in rs]) for k in rs[0]} for name, rs in rounds.items()
    }
    # Each round's gradhub p50 over the echo's p50 measured beside it (same round).
    ratios = spread(
        [
            g["p50_us"] / e["p50_us"]
            for g, e in zip(rounds["gradhub"], rounds["raw zmq echo"], strict=True)
        ]
    )
    lines = [
        f"4-byte pushes, {args.rounds} alternating rounds of {args.pushes}; one-thread copy "
        f"{note['copy_GBps_median']:.1f} GB/s; load average {note['loadavg'][0]:.2f} before, "
        f"{after[0]:.2f} after. Median [min, max] over rounds.",
        "",
        "| system | client CPU us / push | server CPU us / push | p50 us |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, row in rows.items():
        cells = [
            f"{row[k]['median']:.1f} [{row[k]['min']:.1f}, {row[k]['max']:.1f}]"
            for k in ("client_cpu_us", "server_cpu_us", "p50_us")
        ]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    lines += [
        "",
        f"gradhub p50 / echo p50, per round: {ratios['median']:.2f}x "
        f"[{ratios['min']:.2f}, {ratios['max']:.2f}]",
    ]
    report = {
        "machine": note,
        "loadavg_after": list(after),
        "rounds": rounds,
        "rows": rows,
        "p50_ratio": ratios,
    }
    text = "\n".join(lines) + "\n"
    write_results(args.out, "ps_message_cost", report, text)
    print(text)


if __name__ == "__main__":
    main()
