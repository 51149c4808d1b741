"""``gradhub run -n N --survive``: workers that outlive each other's death.

torchrun's elastic agent treats its workers as one unit: when one fails it
stops every other one (and, with restarts left, starts them all again). A
surviving job needs the opposite, so the launcher's process arranges the
workers itself out of torchrun's own pieces:

- **The store.** It hosts the job's c10d ``TCPStore`` (as torchrun's agent
  does for its workers) at ``127.0.0.1:MASTER_PORT`` (across nodes: node 0, at
  the endpoint); it outlives every worker and holds the membership
  (:mod:`gradhub.runtime.membership`).
- **One process context per worker.** Each worker is started with
  ``torch.distributed.elastic.multiprocessing.start_processes`` (torchrun's
  process starter: environment, exit codes, error files) in a context of
  its own, so that one worker's failure closes only its own context.
- **The watch.** Every 50 ms each context is polled (``waitpid``); a worker
  that exited with an error (or was killed) is dead: the next generation is
  recorded at once, the running workers in their old order. A worker that
  exited 0 finished its run. Fewer running workers than ``--min-workers``:
  the generation is recorded as the end of the job; the survivors raise
  :class:`~gradhub.errors.TooFewWorkersError` and exit, and the launcher
  returns 1 naming the dead workers.
- **Replacements** (``--max-restarts R``): a dead worker is replaced, up to R
  times, by a new worker with a new member id. When it has joined the store
  (``gradhub/survive/ready/<id>``) the next generation adds it last; the
  survivors take it in at their next step boundary and it takes the
  parameters and optimizer state from them (:mod:`gradhub.runtime.membership`).
- The launcher's own process is the single point of failure: if it dies the
  store goes with it, and every worker stops at its next store access with
  :class:`~gradhub.errors.WorkerFailedError` naming the store. A whole-job
  restart from checkpoints covers that case.

Across nodes (``--nnodes M``, every node runs the same command with
``--node-rank`` and ``--rdzv-endpoint HOST:PORT``, node 0's address): node 0's
launcher hosts the store at the endpoint and keeps the membership; member ids
are ``node_rank * nproc + i``. Every other node's launcher starts its own
workers, reports each one's death or end to the store at once, and beats a
heartbeat every 0.5 s; a node silent for :data:`SILENT` seconds (its launcher
died with its host) loses all its running workers. Deaths within
:data:`BATCH` seconds of each other (a host's workers killed together) leave
in one generation. Replacements start on node 0. Between a death and its
replacement's arrival, the dead worker's share of every global batch goes to
the survivors.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from gradhub.runtime.membership import (
    JOINING_ENV,
    LATEST,
    MEMBER_ENV,
    PREFIX,
    SURVIVE_ENV,
    publish,
    ready_key,
    stop_key,
)


class LaunchConfig(Protocol):
    """What the supervisor reads of :class:`gradhub.cli.launcher.LaunchConfig`."""

    nproc: int
    nnodes: int
    node_rank: int
    target: list[str]
    module: bool
    min_workers: int
    max_restarts: int


log = logging.getLogger(__name__)

POLL = 0.05
"""Seconds between two looks at the workers' processes."""

GRACE = 30.0
"""Seconds the survivors of a job that ends (too few workers) get to exit by themselves."""


@dataclass
class Watch:
    """The workers of a surviving job and what became of them."""

    contexts: dict[int, Any] = field(default_factory=dict)
    """Member id -> the process context of a worker running on this node."""
    order: list[int] = field(default_factory=list)
    """Member ids in rank order (of every generation so far)."""
    remote: set[int] = field(default_factory=set)
    """Members running on other nodes, as far as their reports say (node 0 only)."""
    dead: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    generation: int = 0
    joining: list[int] = field(default_factory=list)
    """Replacements started and not yet in a generation."""
    restarts: int = 0
    reports: int = 0
    heard: dict[int, tuple[int, float]] = field(default_factory=dict)
    """Other node -> (its heartbeat count, when it last changed)."""

    def running(self) -> list[int]:
        return [m for m in self.order if m in self.contexts or m in self.remote]

    def poll(self) -> list[int]:
        """Members on this node that died since the last poll (those that
        finished are noted)."""
        died = []
        for member, context in list(self.contexts.items()):
            result = context.wait(0)
            if result is None:
                continue
            del self.contexts[member]
            if result.is_failed():
                failure = next(iter(result.failures.values()))
                log.error(
                    "worker %d (pid %s) died: exit code %s", member, failure.pid, failure.exitcode
                )
                died.append(member)
            else:
                self.finished.append(member)
        self.dead += died
        return died

    def heard_from(self, store: dist.Store, nproc: int) -> list[int]:
        """Node 0: members of other nodes that died (their node's reports, or all
        of a node's running members when its launcher fell silent)."""
        died = []
        reports = store.add(_REPORTS, 0)
        if reports != self.reports:
            self.reports = reports
            for member in sorted(self.remote):
                if store.check([f"{PREFIX}died/{member}"]):
                    died.append(member)
                elif store.check([f"{PREFIX}finished/{member}"]):
                    self.finished.append(member)
            self.remote -= set(died) | set(self.finished)
        now = time.monotonic()
        for node, (count, since) in list(self.heard.items()):
            beats = store.add(f"{PREFIX}heartbeat/{node}", 0)
            if beats != count:
                self.heard[node] = (beats, now)
            elif now - since > SILENT:
                lost = sorted(m for m in self.remote if m // nproc == node)
                if lost:
                    log.error("node %d's launcher fell silent: its workers %s are lost", node, lost)
                died += lost
                self.remote -= set(lost)
                del self.heard[node]
        self.dead += died
        return died

    def close(self) -> None:
        for context in self.contexts.values():
            context.close()
        self.contexts.clear()


_REPORTS = f"{PREFIX}reports"
"""Counts the other nodes' reports (a worker of theirs died or finished)."""

SILENT = 5.0
"""Seconds without a heartbeat after which node 0 counts another node's workers lost."""

BATCH = 0.2
"""Seconds a launcher waits after a death for others at the same moment (a
host's workers killed together), so that they leave in one generation."""


def _worker_env(config: LaunchConfig, member: int, addr: str, port: int) -> dict[str, str]:
    n, total = config.nproc, config.nproc * config.nnodes
    local = member % n  # a replacement's: where it lands among n local workers
    # torchrun's default for several workers on a node: one intra-op thread each
    # (the workers would otherwise each take every core), unless the user set one.
    threads = {"OMP_NUM_THREADS": "1"} if n > 1 and "OMP_NUM_THREADS" not in os.environ else {}
    return {
        **threads,
        "RANK": str(member % total),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(total),
        "LOCAL_WORLD_SIZE": str(n),
        "GROUP_RANK": str(config.node_rank),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        SURVIVE_ENV: "1",
        MEMBER_ENV: str(member),
        JOINING_ENV: "1" if member >= total else "0",
    }


def _start(config: LaunchConfig, member: int, addr: str, port: int, logs: str) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    target = ["-m", *config.target] if config.module else list(config.target)
    folder = Path(logs) / f"worker-{member}"
    folder.mkdir(parents=True, exist_ok=True)
    return start_processes(
        name=f"gradhub-worker-{member}",
        entrypoint=sys.executable,
        args={0: ("-u", *target)},
        envs={0: _worker_env(config, member, addr, port)},
        logs_specs=DefaultLogsSpecs(log_dir=str(folder)),
    )


def supervise(config: LaunchConfig, logs: str, addr: str, port: int, hosting: bool) -> int:
    """Run this node's part of a surviving job to its end. The node that hosts the
    store at ``addr:port`` (node 0) keeps the membership; the others report to
    it. Node 0 returns 0 when every worker that did not die finished (and at
    least ``min_workers`` did), else 1; another node returns 0 unless the job
    was stopped for too few workers."""
    store = dist.TCPStore(
        addr, port, is_master=hosting, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    n, node = config.nproc, config.node_rank
    local = [node * n + i for i in range(n)]
    watch = Watch(order=list(range(n * config.nnodes)) if hosting else local)
    if hosting:
        watch.remote = set(watch.order) - set(local)
        begun = time.monotonic() + 60.0  # the other nodes' first heartbeat may take a while
        watch.heard = {other: (0, begun) for other in range(1, config.nnodes)}
        publish(store, 0, watch.order, [])
    try:
        for member in local:
            watch.contexts[member] = _start(config, member, addr, port, logs)
        log.info("%d workers started (survive: at least %d)", n, config.min_workers)
        if hosting:
            _keep(watch, store, config, logs, addr, port)
        else:
            _report(watch, store, node)
    finally:
        watch.close()
    if not hosting:
        latest = int(store.get(LATEST)) if store.check([LATEST]) else 0
        return 1 if store.check([stop_key(latest)]) else 0
    return _verdict(watch, config)


def _keep(
    watch: Watch, store: dist.Store, config: LaunchConfig, logs: str, addr: str, port: int
) -> None:
    """Node 0's watch: deaths here and elsewhere become generations; replacements join."""
    while watch.contexts or watch.remote:
        died = watch.poll() + watch.heard_from(store, config.nproc)
        if died:
            time.sleep(BATCH)
            died += watch.poll() + watch.heard_from(store, config.nproc)
        lost = [m for m in died if m in watch.joining]  # a replacement that never joined
        watch.joining = [m for m in watch.joining if m not in lost]
        if died:
            if len(lost) < len(died) and _record(
                store, watch, config, [m for m in died if m not in lost], []
            ):
                _end(watch)
                return
            for _ in died:
                if watch.restarts < config.max_restarts:
                    watch.restarts += 1
                    member = config.nproc * config.nnodes + watch.restarts - 1
                    watch.joining.append(member)
                    watch.contexts[member] = _start(config, member, addr, port, logs)
                    log.warning("worker %d started to replace a dead one", member)
        ready = [m for m in watch.joining if store.check([ready_key(m)])]
        if ready:
            watch.joining = [m for m in watch.joining if m not in ready]
            watch.order += ready
            _record(store, watch, config, [], ready)
        time.sleep(POLL)


def _report(watch: Watch, store: dist.Store, node: int) -> None:
    """Another node's watch: tell node 0 what became of each worker, and beat."""
    beat = 0.0
    while watch.contexts:
        done = len(watch.finished)
        for member in watch.poll():
            store.set(f"{PREFIX}died/{member}", "1")
            store.add(_REPORTS, 1)
        for member in watch.finished[done:]:
            store.set(f"{PREFIX}finished/{member}", "1")
            store.add(_REPORTS, 1)
        if time.monotonic() - beat >= 0.5:
            store.add(f"{PREFIX}heartbeat/{node}", 1)
            beat = time.monotonic()
        time.sleep(POLL)


def _verdict(watch: Watch, config: LaunchConfig) -> int:
    alive = len(watch.finished)
    if watch.dead and (alive < config.min_workers or alive == 0):
        log.error(
            "job failed: worker(s) %s died, %d finished (--min-workers %d)",
            ", ".join(map(str, watch.dead)),
            alive,
            config.min_workers,
        )
        return 1
    if watch.dead:
        log.warning(
            "job finished over %d worker(s); worker(s) %s died on the way",
            alive,
            ", ".join(map(str, watch.dead)),
        )
    return 0


def _record(
    store: dist.Store, watch: Watch, config: LaunchConfig, died: list[int], joined: list[int]
) -> bool:
    """Publish the next generation: the running members (replacements not ready
    left out); True if it is the end of the job (too few)."""
    watch.generation += 1
    members = [m for m in watch.running() if m not in watch.joining]
    stop = len(members) < config.min_workers
    publish(store, watch.generation, members, died, stop=stop)
    what = f"worker(s) {', '.join(map(str, died))} died" if died else f"{joined} joined"
    log.warning(
        "generation %d: %s; %s over %s",
        watch.generation,
        what,
        "the job stops" if stop else "the job goes on",
        members,
    )
    return stop


def _end(watch: Watch) -> None:
    """Let the survivors of a stopped job exit by themselves, then stop them."""
    deadline = time.monotonic() + GRACE
    while watch.contexts and time.monotonic() < deadline:
        for member, context in list(watch.contexts.items()):
            if context.wait(0) is not None:
                del watch.contexts[member]
        time.sleep(POLL)
    watch.close()
