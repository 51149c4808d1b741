"""Parameter-server push/pull: gradhub vs a torch.distributed.rpc server vs a Ray actor.

Every system runs one server process on this machine and one client (this
process). Each op is synchronous (issue, wait for the answer), so latency is
the round trip and ops/s is 1 / mean latency; GB/s counts the tensor bytes
moved per op. Sizes and systems alternate within each round (A, B, C, A, B,
C, ...), so slow drift of the machine affects all alike. The server applies
``value -= lr * grad`` on push (gradhub: its server-side SGD); pull copies the
value into a preallocated tensor on the client.

    .venv/bin/python benchmarks/parameter_server.py [--quick] [--out DIR]

Writes ``parameter_server.json`` and ``parameter_server.md`` to ``--out``
(default ``benchmarks/results``) and prints the Markdown table. Ray is used
only if it can be imported (``pip install gradhub[bench]``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from _common import RESULTS, write_results

SIZES = {"4 B": 4, "4 KB": 4 << 10, "1 MB": 1 << 20, "16 MB": 16 << 20, "100 MB": 100 << 20}
LR = 1e-9


def _iters(nbytes: int, quick: bool) -> int:
    n = 2000 if nbytes <= 4096 else 200 if nbytes <= 1 << 20 else 30 if nbytes <= 16 << 20 else 8
    return max(4, n // 4) if quick else n


# ------------------------------------------------------------------ gradhub
class Gradhub:
    name = "gradhub"

    def __init__(self) -> None:
        from gradhub import RemoteParameterServer, ServerConfig, start_server

        self.server = start_server(ServerConfig(optimizer="sgd", lr=LR))
        self.client = RemoteParameterServer(self.server.address, worker_id=0, timeout=120)

    def init(self, key: str, value: torch.Tensor) -> None:
        self.client.init(key, value)

    def push(self, key: str, grad: torch.Tensor) -> None:
        self.client.push(key, grad).result()

    def pull(self, key: str, out: torch.Tensor) -> None:
        self.client.pull(key, out).result()

    def close(self) -> None:
        self.client.close()
        self.server.close()


# ---------------------------------------------------------------- torch RPC
_RPC_STORE: dict[str, torch.Tensor] = {}


def _rpc_init(key: str, value: torch.Tensor) -> None:
    _RPC_STORE[key] = value.clone()


def _rpc_push(key: str, grad: torch.Tensor) -> None:
    _RPC_STORE[key].add_(grad, alpha=-LR)


def _rpc_pull(key: str) -> torch.Tensor:
    return _RPC_STORE[key]


def _rpc_server(port: int) -> None:
    from torch.distributed import rpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rpc.init_rpc("server", rank=1, world_size=2)
    rpc.shutdown()  # serves until the client shuts down too


class TorchRPC:
    name = "torch.rpc"

    def __init__(self) -> None:
        from torch.distributed import rpc

        self.rpc = rpc
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = mp.get_context("spawn").Process(target=_rpc_server, args=(port,), daemon=True)
        self.proc.start()
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        rpc.init_rpc("client", rank=0, world_size=2)

    def init(self, key: str, value: torch.Tensor) -> None:
        self.rpc.rpc_sync("server", _rpc_init, args=(key, value))

    def push(self, key: str, grad: torch.Tensor) -> None:
        self.rpc.rpc_sync("server", _rpc_push, args=(key, grad))

    def pull(self, key: str, out: torch.Tensor) -> None:
        out.copy_(self.rpc.rpc_sync("server", _rpc_pull, args=(key,)))

    def close(self) -> None:
        self.rpc.shutdown()
        self.proc.join(30)


# ---------------------------------------------------------------------- Ray
class RayActor:
    name = "ray actor"

    def __init__(self) -> None:
        import ray

        self.ray = ray
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")

        @ray.remote
        class Store:
            def __init__(self) -> None:
                self.values: dict[str, torch.Tensor] = {}

            def init(self, key: str, value: torch.Tensor) -> None:
                self.values[key] = value.clone()

            def push(self, key: str, grad: torch.Tensor) -> None:
                self.values[key].add_(grad, alpha=-LR)

            def pull(self, key: str) -> torch.Tensor:
                return self.values[key]

        self.actor = Store.remote()  # type: ignore[attr-defined]

    def init(self, key: str, value: torch.Tensor) -> None:
        self.ray.get(self.actor.init.remote(key, value))

    def push(self, key: str, grad: torch.Tensor) -> None:
        self.ray.get(self.actor.push.remote(key, grad))

    def pull(self, key: str, out: torch.Tensor) -> None:
        out.copy_(self.ray.get(self.actor.pull.remote(key)))

    def close(self) -> None:
        self.ray.shutdown()


# ----------------------------------------------------------------- driver
def _time(fn: Callable[[], None], n: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the iterations")
    parser.add_argument("--rounds", type=int, default=3, help="alternation rounds")
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    systems: list[Any] = [Gradhub(), TorchRPC()]
    try:
        systems.append(RayActor())
    except ImportError:
        print("ray is not installed (pip install 'gradhub[bench]'): skipping the Ray actor")
    samples: dict[tuple[str, str, str], list[float]] = {}
    per_round: dict[tuple[str, str, str], list[float]] = {}
    try:
        for label in args.sizes:
            nbytes = SIZES[label]
            numel = max(1, nbytes // 4)
            value, grad = torch.randn(numel), torch.randn(numel)
            key = f"w{numel}"
            for s in systems:
                s.init(key, value)
            out = torch.empty(numel)
            n = max(2, _iters(nbytes, args.quick) // args.rounds)
            for _ in range(args.rounds):
                for op in ("push", "pull"):
                    for s in systems:
                        if op == "push":
                            lat = _time(lambda s=s, k=key, g=grad: s.push(k, g), n)
                        else:
                            lat = _time(lambda s=s, k=key, o=out: s.pull(k, o), n)
                        samples.setdefault((label, op, s.name), []).extend(lat)
                        per_round.setdefault((label, op, s.name), []).append(statistics.median(lat))
            print(f"{label}: done", file=sys.stderr)
    finally:
        for s in systems:
            s.close()

    rows = []
    names = [s.name for s in systems]
    for (label, op, name), lat in samples.items():
        mean = statistics.fmean(lat)
        ratio = None
        if name != "gradhub":
            mine, theirs = per_round[(label, op, "gradhub")], per_round[(label, op, name)]
            ratios = [t / m for m, t in zip(mine, theirs, strict=True)]
            ratio = (statistics.median(ratios), min(ratios), max(ratios))
        rows.append(
            {
                "size": label,
                "bytes": SIZES[label],
                "op": op,
                "system": name,
                "n": len(lat),
                "p50_ms": _percentile(lat, 0.5) * 1e3,
                "p99_ms": _percentile(lat, 0.99) * 1e3,
                "ops_per_s": 1 / mean,
                "gb_per_s": SIZES[label] / mean / 1e9,
                "gradhub_speedup": ratio,  # peer p50 / gradhub p50 per round: median, min, max
            }
        )
    meta = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "systems": names,
        "rounds": args.rounds,
        "note": "one client and one server process on this machine; synchronous ops",
    }
    md = _markdown(rows, meta)
    write_results(args.out, "parameter_server", {"meta": meta, "rows": rows}, md)
    print(md)
    return 0


def _markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"Parameter server push/pull, {meta['cpus']} CPUs, torch {meta['torch']}; "
        f"{meta['note']}. Speedup = peer p50 / gradhub p50 (median of {meta['rounds']} "
        "alternating rounds, [min, max]).",
        "",
        "| size | op | system | n | p50 ms | p99 ms | ops/s | GB/s | gradhub speedup |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        sp = r["gradhub_speedup"]
        speed = "" if sp is None else f"{sp[0]:.2f}x [{sp[1]:.2f}, {sp[2]:.2f}]"
        lines.append(
            f"| {r['size']} | {r['op']} | {r['system']} | {r['n']} | {r['p50_ms']:.3f} | "
            f"{r['p99_ms']:.3f} | {r['ops_per_s']:.0f} | {r['gb_per_s']:.3f} | {speed} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
