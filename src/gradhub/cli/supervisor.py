"""``gradhub run -n N --survive``: workers that outlive each other's death.

torchrun's elastic agent treats its workers as one unit: when one fails it
stops every other one (and, with restarts left, starts them all again). A
surviving job needs the opposite, so the launcher's process arranges the
workers itself out of torchrun's own pieces:

- **The store.** It hosts the job's c10d ``TCPStore`` (as torchrun's agent
  does for its workers) at ``127.0.0.1:MASTER_PORT``; it outlives every
  worker and holds the membership (:mod:`gradhub.runtime.membership`).
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

One node only (``--nnodes 1``). Between a death and its replacement's
arrival, the dead worker's share of every global batch goes to the survivors.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from gradhub.runtime.membership import JOINING_ENV, MEMBER_ENV, SURVIVE_ENV, publish, ready_key

if TYPE_CHECKING:
    from gradhub.cli.launcher import LaunchConfig

log = logging.getLogger(__name__)

POLL = 0.05
"""Seconds between two looks at the workers' processes."""

GRACE = 30.0
"""Seconds the survivors of a job that ends (too few workers) get to exit by themselves."""


@dataclass
class Watch:
    """The workers of a surviving job and what became of them."""

    contexts: dict[int, Any] = field(default_factory=dict)
    """Member id -> its running process context."""
    order: list[int] = field(default_factory=list)
    """Member ids in rank order (of every generation so far)."""
    dead: list[int] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)
    generation: int = 0
    joining: list[int] = field(default_factory=list)
    """Replacements started and not yet in a generation."""
    restarts: int = 0

    def running(self) -> list[int]:
        return [m for m in self.order if m in self.contexts]

    def poll(self) -> list[int]:
        """Members that died since the last poll (those that finished are noted)."""
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

    def close(self) -> None:
        for context in self.contexts.values():
            context.close()
        self.contexts.clear()


def _worker_env(config: LaunchConfig, member: int, port: int) -> dict[str, str]:
    n = config.nproc
    rank = member % n  # a replacement's: where it lands among n local workers
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(n),
        "LOCAL_WORLD_SIZE": str(n),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        SURVIVE_ENV: "1",
        MEMBER_ENV: str(member),
        JOINING_ENV: "1" if member >= n else "0",
    }


def _start(config: LaunchConfig, member: int, port: int, logs: str) -> Any:
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes

    target = ["-m", *config.target] if config.module else list(config.target)
    folder = Path(logs) / f"worker-{member}"
    folder.mkdir(parents=True, exist_ok=True)
    return start_processes(
        name=f"gradhub-worker-{member}",
        entrypoint=sys.executable,
        args={0: ("-u", *target)},
        envs={0: _worker_env(config, member, port)},
        logs_specs=DefaultLogsSpecs(log_dir=str(folder)),
    )


def supervise(config: LaunchConfig, port: int, logs: str) -> int:
    """Run a surviving job to its end; 0 when every worker that did not die
    finished (and at least ``min_workers`` did), else 1."""
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    watch = Watch(order=list(range(config.nproc)))
    publish(store, 0, watch.order, [])
    try:
        for member in watch.order:
            watch.contexts[member] = _start(config, member, port, logs)
        log.info("%d workers started (survive: at least %d)", config.nproc, config.min_workers)
        while watch.contexts:
            died = watch.poll()
            lost = [m for m in died if m in watch.joining]  # a replacement that never joined
            watch.joining = [m for m in watch.joining if m not in lost]
            if died:
                if len(lost) < len(died) and _record(
                    store, watch, config, [m for m in died if m not in lost], []
                ):
                    _end(watch)
                    break
                for _ in died:
                    if watch.restarts < config.max_restarts:
                        watch.restarts += 1
                        member = config.nproc + watch.restarts - 1
                        watch.joining.append(member)
                        watch.contexts[member] = _start(config, member, port, logs)
                        log.warning("worker %d started to replace a dead one", member)
            ready = [m for m in watch.joining if store.check([ready_key(m)])]
            if ready:
                watch.joining = [m for m in watch.joining if m not in ready]
                watch.order += ready
                _record(store, watch, config, [], ready)
            time.sleep(POLL)
    finally:
        watch.close()
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
