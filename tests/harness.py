"""Multi-process test harness: real processes on 127.0.0.1.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes
(forked from a server that has imported torch and gradhub once), each with
the launcher's standard environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR=127.0.0.1, MASTER_PORT=<a free port>), calls
``fn(rank, world_size, *args)`` in each and returns the list of
:class:`RankResult`. Every process is killed when the time is up, so no test
leaves children behind. ``fn`` must be a module-level function of an
importable module (tests are on ``sys.path`` under pytest).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_PICK = random.SystemRandom()  # not the random module's state, which a test may seed


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's
    ephemeral range (a port from it may become another test's client end
    before this one binds it: EADDRINUSE, seen with two workers).

    (gradhub's ``free_loopback_port`` does the same; not imported: importing
    gradhub would import torch into every child, also those that do not need it.)
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", _PICK.randrange(10_000, low) if low > 10_000 else 0))
            except OSError:
                continue
            return int(s.getsockname()[1])
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None  # the traceback text when the rank raised
    exitcode: int | None = None
    killed: bool = False  # still running at the timeout, killed by the harness

    @property
    def ok(self) -> bool:
        return self.error is None and self.exitcode == 0


class RanksFailed(AssertionError):
    def __init__(self, results: list[RankResult]):
        self.results = results
        lines = []
        for r in results:
            if not r.ok:
                lines.append(f"--- rank {r.rank} (exit code {r.exitcode}) ---\n{r.error or ''}")
        super().__init__("\n".join(lines))


def wait_until(check: Callable[[], bool], seconds: float) -> bool:
    """Whether ``check()`` came true within ``seconds`` (asked every 50 ms)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    args: tuple[Any, ...],
    env: dict[str, str],
    results: Any,
) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            **env,
        }
    )
    try:
        value = fn(rank, world_size, *args)
    except BaseException:
        results.put((rank, None, traceback.format_exc()))
    else:
        results.put((rank, value, None))


# The modules every rank imports: the fork server imports them once, and each
# rank is forked from it, already holding them (several seconds of CPU per
# rank otherwise). The server imports only: no thread pool has run in it, so
# forking it is safe; each rank still gets a fresh interpreter state for the
# rest, like a spawned process. ``torch._dynamo`` is what the first torch
# optimizer built in a process imports (about 2 s of CPU per rank); it starts
# no thread either.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "gradhub", "gradhub.train"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes.

    With ``check`` (the default) any failed rank raises :class:`RanksFailed`
    carrying every rank's traceback; otherwise the results are returned as they are.
    """
    ctx = _context()
    results_q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, port, args, dict(env or {}), results_q),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    results = {rank: RankResult(rank) for rank in range(world_size)}
    received: set[int] = set()
    deadline = time.monotonic() + timeout
    try:
        while len(received) < world_size and time.monotonic() < deadline:
            try:
                rank, value, error = results_q.get(timeout=0.2)
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results_q.empty():
                    break
                continue
            results[rank].value, results[rank].error = value, error
            received.add(rank)
        for p in procs:
            # A rank that returned may still be tearing down (a broken gloo
            # group finishes its pending work first, bounded by its timeout).
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for rank, p in enumerate(procs):
            if p.is_alive():
                results[rank].killed = True
                p.kill()
                p.join(5)
        results_q.close()
        results_q.join_thread()
    for rank, p in enumerate(procs):
        r = results[rank]
        r.exitcode = p.exitcode
        if rank not in received and r.error is None:
            why = f"killed after {timeout:g}s" if r.killed else f"exit code {p.exitcode}"
            r.error = f"rank {rank} gave no result ({why})"
        elif r.killed and r.error is None:
            r.error = f"rank {rank} returned but did not exit; killed after {timeout:g}s"

    out = [results[r] for r in range(world_size)]
    if check and not all(r.ok for r in out):
        raise RanksFailed(out)
    return out
