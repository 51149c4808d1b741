"""Parameter-server push/pull: gradhub vs a torch.distributed.rpc server vs a Ray actor,
and gradhub's ``--durable`` server beside its default.

``gradhub`` is the default client of a server on the same host: payloads of
64 KiB or more go through the shared arena. ``gradhub shared`` is the same
client given tensors it allocated in its arena (``RemoteParameterServer.empty_like``:
the gradient pushed and the tensor pulled into, each allocated once): the
server reads the push and writes the pull where they lie, no copy in the
client. ``gradhub zmq`` is the same with
``arena=False`` (every byte through ZeroMQ over loopback TCP, the path across
hosts). ``raw zmq echo`` is the floor for small messages: a pyzmq DEALER
sending the 4 bytes to a ROUTER in another process that sends them back
(sizes up to 4 KB); a gradhub push should cost about one such round trip.

Every system runs one server process on this machine and one client (this
process). Each op is synchronous (issue, wait for the answer), so latency is
the round trip and ops/s is 1 / mean latency; GB/s counts the tensor bytes
moved per op. Sizes and systems alternate within each round (A, B, C, A, B,
C, ...), so slow drift of the machine affects all alike. The server applies
``value -= lr * grad`` on push (gradhub: its server-side SGD); pull copies the
value into a preallocated tensor on the client.

    .venv/bin/python benchmarks/parameter_server.py [--quick] [--out DIR]

``gradhub --durable`` is the same server with ``durable=True`` (a write-ahead
log in a checkpoint directory on this machine's disk, ``fsync`` before each
acknowledgement); its ratio column is its cost: durable p50 / default p50.
Durable rows are measured for pushes up to 16 MB (pulls do not touch the log).
A second table has several workers (threads, one client each) pushing small
gradients at once for a few seconds, to the default and to the durable server
alternately: pushes per second and, for the durable one, pushes per ``fsync``
(group commit: the server syncs once per batch of requests it drained).

Floors, from this machine's one-thread copy bandwidth C (bytes copied per
second, measured at the start and recorded with the load average): a
same-host push of B bytes copies the gradient into the arena (B) and the
server's SGD reads the value and the gradient and writes the value (1.5 B of
copying): 2.5 B / C; a pull copies the value into the arena and out of it
again: 2 B / C. ``gradhub shared`` copies nothing in the client: a push is
the server's SGD alone, 1.5 B / C; a pull is the server's copy into the
tensor, 1 B / C. Both sides run one after the other (synchronous ops).

Writes ``parameter_server.json`` and ``parameter_server.md`` to ``--out``
(default ``benchmarks/results``) and prints the Markdown table. Ray is used
only if it can be imported (``pip install gradhub[bench]``).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from _common import RESULTS, machine_note, write_results

SIZES = {
    "4 B": 4,
    "4 KB": 4 << 10,
    "1 MB": 1 << 20,
    "16 MB": 16 << 20,
    "64 MB": 64 << 20,
    "100 MB": 100 << 20,
}
GOAL_SIZES = ("16 MB", "64 MB")
LR = 1e-9


def _iters(nbytes: int, quick: bool) -> int:
    n = 2000 if nbytes <= 4096 else 200 if nbytes <= 1 << 20 else 30 if nbytes <= 16 << 20 else 10
    return max(4, n // 4) if quick else n


# ------------------------------------------------------------------ gradhub
class Gradhub:
    name = "gradhub"
    max_push = 1 << 40
    max_pull = 1 << 40

    def __init__(self, client: dict[str, Any] | None = None, **config: Any) -> None:
        from gradhub import RemoteParameterServer, ServerConfig, start_server

        self.server = start_server(ServerConfig(optimizer="sgd", lr=LR, **config))
        self.client = RemoteParameterServer(
            self.server.address, worker_id=0, timeout=120, **(client or {})
        )

    def init(self, key: str, value: torch.Tensor) -> None:
        self.client.init(key, value)

    def push(self, key: str, grad: torch.Tensor) -> None:
        self.client.push(key, grad).result()

    def pull(self, key: str, out: torch.Tensor) -> None:
        self.client.pull(key, out).result()

    def close(self) -> None:
        self.client.close()
        self.server.close()


class GradhubShared(Gradhub):
    """The user's tensors in the client's arena: each tensor the benchmark passes has
    a twin from ``empty_like`` (made and filled once, in the warm-up call), and
    that twin is what is pushed or pulled into."""

    name = "gradhub shared"

    def __init__(self) -> None:
        super().__init__()
        self.twins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def twin(self, t: torch.Tensor) -> torch.Tensor:
        kept = self.twins.get(id(t))
        if kept is None or kept[0] is not t:
            kept = self.twins[id(t)] = (t, self.client.shared_like(t))
        return kept[1]

    def push(self, key: str, grad: torch.Tensor) -> None:
        self.client.push(key, self.twin(grad)).result()

    def pull(self, key: str, out: torch.Tensor) -> None:
        self.client.pull(key, self.twin(out)).result()


class GradhubZmq(Gradhub):
    name = "gradhub zmq"

    def __init__(self) -> None:
        super().__init__(client={"arena": False})


class GradhubDurable(Gradhub):
    name = "gradhub --durable"
    max_push = 16 << 20
    max_pull = 0

    def __init__(self, folder: str) -> None:
        # Checkpoints only when the log is full: each push pays its log write and fsync.
        super().__init__(checkpoint_dir=folder, durable=True, checkpoint_every=3600.0)


def concurrent_pushes(
    address: str, workers: int, nbytes: int, seconds: float
) -> tuple[float, dict[str, int]]:
    """Pushes per second of ``workers`` clients pushing at once; the server's counters."""
    from gradhub import DuplicateParameterError, RemoteParameterServer

    grad = torch.randn(max(1, nbytes // 4))
    key = f"c{workers}x{grad.numel()}"
    clients = [
        RemoteParameterServer(address, worker_id=100 + w, timeout=120) for w in range(workers)
    ]
    with contextlib.suppress(DuplicateParameterError):  # kept from an earlier run
        clients[0].init(key, torch.zeros_like(grad))
    counts = [0] * workers
    stop = time.monotonic() + seconds

    def run(w: int) -> None:
        while time.monotonic() < stop:
            clients[w].push(key, grad).result()
            counts[w] += 1

    before = clients[0].stats()[0]["counters"]
    threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    after = clients[0].stats()[0]["counters"]
    for c in clients:
        c.close()
    return sum(counts) / elapsed, {k: after[k] - before[k] for k in after}


# ------------------------------------------------------------ raw pyzmq echo
def _echo_server(address: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    address.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == b"stop":
            break
        sock.send_multipart(frames, copy=False)
    sock.close(0)
    ctx.term()


class ZmqEcho:
    """A DEALER sending the tensor's bytes to a ROUTER echo in another process."""

    name = "raw zmq echo"
    max_push = max_pull = 4 << 10

    def __init__(self) -> None:
        import zmq

        ctx = mp.get_context("spawn")
        address = ctx.Queue()
        self.proc = ctx.Process(target=_echo_server, args=(address,), daemon=True)
        self.proc.start()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(address.get(timeout=60))

    def init(self, key: str, value: torch.Tensor) -> None:
        pass

    def push(self, key: str, grad: torch.Tensor) -> None:
        self.sock.send(grad.numpy().tobytes())
        self.sock.recv()

    def pull(self, key: str, out: torch.Tensor) -> None:
        self.sock.send(out.numpy().tobytes())
        reply = bytearray(self.sock.recv())
        out.copy_(torch.frombuffer(reply, dtype=out.dtype).view(out.shape))

    def close(self) -> None:
        self.sock.send_multipart([b"stop"])
        self.sock.close(0)
        self.ctx.term()
        self.proc.join(10)


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
    parser.add_argument("--rounds", type=int, default=5, help="alternation rounds (>= 5)")
    parser.add_argument("--sizes", nargs="*", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--workers", type=int, default=4, help="concurrent pushers")
    parser.add_argument("--seconds", type=float, default=3.0, help="per concurrent run")
    parser.add_argument("--only-gradhub", action="store_true", help="skip torch.rpc and Ray")
    parser.add_argument(
        "--no-concurrent", action="store_true", help="skip the concurrent pushers' table"
    )
    args = parser.parse_args(argv)
    if args.rounds < 5:
        parser.error("--rounds must be at least 5")
    note = machine_note()  # before this run loads the machine
    load = note["loadavg"][0]
    torch.set_num_threads(1)

    Path(args.out).mkdir(parents=True, exist_ok=True)
    wal_dir = tempfile.mkdtemp(prefix=".wal-", dir=args.out)  # on disk, not a tmpfs
    default, durable = Gradhub(), GradhubDurable(wal_dir)
    systems: list[Any] = [default, GradhubShared(), GradhubZmq(), durable, ZmqEcho()]
    if not args.only_gradhub:
        systems.append(TorchRPC())
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
                        if nbytes > getattr(s, f"max_{op}", 1 << 40):
                            continue
                        if op == "push":
                            lat = _time(lambda s=s, k=key, g=grad: s.push(k, g), n)
                        else:
                            lat = _time(lambda s=s, k=key, o=out: s.pull(k, o), n)
                        samples.setdefault((label, op, s.name), []).extend(lat)
                        per_round.setdefault((label, op, s.name), []).append(statistics.median(lat))
            print(f"{label}: done", file=sys.stderr)
        concurrent = [] if args.no_concurrent else _concurrent([default, durable], args)
    finally:
        for s in systems:
            s.close()
        shutil.rmtree(wal_dir, ignore_errors=True)

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
                "floor_ms": _floor(SIZES[label], op, note["copy_GBps_median"], name) * 1e3,
            }
        )
    meta = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "systems": names,
        "rounds": args.rounds,
        "copy_bandwidth": note,
        "loadavg_after": list(os.getloadavg()),
        "note": "one client and one server process on this machine; synchronous ops; "
        f"load average {load:.1f} when the run started, {os.getloadavg()[0]:.1f} at its end; "
        f"one-thread copy {note['copy_GBps_median']:.1f} GB/s "
        f"[{note['copy_GBps_min']:.1f}, {note['copy_GBps_max']:.1f}]",
    }
    goals = _goals(per_round)
    md = _markdown(rows, meta) + "\n" + _goals_markdown(goals)
    if concurrent:
        md += "\n" + _concurrent_markdown(concurrent, args)
    report = {"meta": meta, "rows": rows, "goals": goals, "concurrent": concurrent}
    write_results(args.out, "parameter_server", report, md)
    print(md)
    return 0


def _floor(nbytes: int, op: str, copy_gbps: float, system: str = "gradhub") -> float:
    """Seconds the same-host arena must spend copying (see the module docstring)."""
    if system == "gradhub shared":
        return (1.5 if op == "push" else 1.0) * nbytes / (copy_gbps * 1e9)
    return (2.5 if op == "push" else 2.0) * nbytes / (copy_gbps * 1e9)


def _goals(per_round: dict[tuple[str, str, str], list[float]]) -> list[dict[str, Any]]:
    """The same-host targets, each a ratio of p50s taken in the same rounds:
    push/pull bandwidth of gradhub (arena), gradhub shared (the user's tensors in
    the arena) and gradhub zmq over torch.rpc's at 16 and 64 MB, and gradhub's
    4-byte push p50 over the raw ZeroMQ echo's."""
    out = []

    def ratio(label: str, op: str, num: str, den: str) -> tuple[float, float, float] | None:
        a, b = per_round.get((label, op, num)), per_round.get((label, op, den))
        if not a or not b:
            return None
        r = [x / y for x, y in zip(a, b, strict=True)]
        return statistics.median(r), min(r), max(r)

    for label in GOAL_SIZES:
        for op in ("push", "pull"):
            for name in ("gradhub", "gradhub shared", "gradhub zmq"):
                r = ratio(label, op, "torch.rpc", name)  # rpc time / ours = our GB/s / rpc's
                if r is not None:
                    what = f"{name} {op} GB/s / torch.rpc GB/s, {label}"
                    out.append({"what": what, "goal": ">= 2", "ratio": r})
    for op in ("push", "pull"):
        r = ratio("4 B", op, "gradhub", "raw zmq echo")
        if r is not None:
            what = f"gradhub 4 B {op} p50 / raw zmq echo p50"
            out.append({"what": what, "goal": "<= 2" if op == "push" else "", "ratio": r})
    return out


def _goals_markdown(goals: list[dict[str, Any]]) -> str:
    lines = [
        "Same-host targets: ratios of p50s taken in the same alternating rounds "
        "(median [min, max] over rounds).",
        "",
        "| figure | goal | measured |",
        "| --- | --- | --- |",
    ]
    for g in goals:
        m, lo, hi = g["ratio"]
        lines.append(f"| {g['what']} | {g['goal']} | {m:.2f} [{lo:.2f}, {hi:.2f}] |")
    return "\n".join(lines) + "\n"


def _concurrent(systems: list[Any], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Default and durable servers under ``args.workers`` concurrent 4 KB pushers, A/B/A/B."""
    out: list[dict[str, Any]] = []
    for workers in (1, args.workers):
        for _ in range(args.rounds):
            for s in systems:
                rate, counters = concurrent_pushes(s.server.address, workers, 4 << 10, args.seconds)
                syncs = counters.get("log_syncs", 0)
                out.append(
                    {
                        "system": s.name,
                        "workers": workers,
                        "pushes_per_s": rate,
                        "pushes": counters["push_applied"],
                        "fsyncs": syncs,
                    }
                )
        print(f"{workers} concurrent pusher(s): done", file=sys.stderr)
    return out


def _concurrent_markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"Concurrent 4 KB pushes for {args.seconds:g} s per run ({args.rounds} runs each, "
        "alternating default and durable; threads of one process, one client each). "
        "Median over runs.",
        "",
        "| workers | system | pushes/s | durable / default | pushes per fsync |",
        "| ---: | --- | ---: | ---: | ---: |",
    ]
    for workers in sorted({r["workers"] for r in rows}):
        mine = [r for r in rows if r["workers"] == workers]
        rate = {
            name: statistics.median(r["pushes_per_s"] for r in mine if r["system"] == name)
            for name in dict.fromkeys(r["system"] for r in mine)
        }
        for name, value in rate.items():
            durable = [r for r in mine if r["system"] == name and r["fsyncs"]]
            per_sync = (
                f"{sum(r['pushes'] for r in durable) / sum(r['fsyncs'] for r in durable):.2f}"
                if durable
                else ""
            )
            ratio = f"{value / rate['gradhub']:.2f}" if name != "gradhub" else ""
            lines.append(f"| {workers} | {name} | {value:.0f} | {ratio} | {per_sync} |")
    return "\n".join(lines) + "\n"


def _markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"Parameter server push/pull, {meta['cpus']} CPUs, torch {meta['torch']}; "
        f"{meta['note']}. Speedup = peer p50 / gradhub p50 (median of {meta['rounds']} "
        "alternating rounds, [min, max]); for gradhub --durable this ratio is its cost "
        "(durable p50 / default p50).",
        "",
        "| size | op | system | n | p50 ms | p99 ms | floor ms | ops/s | GB/s | gradhub speedup |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        sp = r["gradhub_speedup"]
        speed = "" if sp is None else f"{sp[0]:.2f}x [{sp[1]:.2f}, {sp[2]:.2f}]"
        lines.append(
            f"| {r['size']} | {r['op']} | {r['system']} | {r['n']} | {r['p50_ms']:.3f} | "
            f"{r['p99_ms']:.3f} | {r['floor_ms']:.3f} | {r['ops_per_s']:.0f} | "
            f"{r['gb_per_s']:.3f} | {speed} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
