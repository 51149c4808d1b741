"""Consistency modes of a parameter server: async, sync (dist_sync) and ssp.

A worker's **step on a key** is the number of pushes the server has taken from
it for that key. Workers need no explicit clock: pushing a key advances the
worker on it, and a pull is judged against the steps of the live workers.

- ``async``: every push is applied on arrival (a surviving job's: below);
  pulls never wait.
- ``sync`` (MXNet ``dist_sync``): a worker's n-th push of a key joins round n
  of that key; gradients of a round are summed and applied **once**, when every
  live worker has pushed for it (and at least ``workers`` distinct workers have
  registered). A pull waits until every round the worker has pushed to is
  applied, so it sees the aggregate of the round.
- ``ssp`` (bounded staleness, ``max_staleness=K``): pushes are applied on
  arrival; a pull by a worker more than ``K`` steps ahead of the slowest live
  worker on that key waits until the slow one catches up (or is dropped).

Membership: a worker joins with its first push. A worker that
has been silent longer than the heartbeat timeout is *dropped*: it no longer
counts for rounds or staleness, so the others stop waiting for it. A dropped
worker that speaks again rejoins at the current round (sync) or at the step
of the slowest live worker (ssp), so it does not hold the others back.

Decision: until ``workers`` distinct workers have registered, the missing ones
count as live workers at step 0, so an early starter does not run rounds alone.

A surviving job (``gradhub run --survive``) says who its workers are
(:meth:`Consistency.set_members`, each membership generation after a worker's
death or a replacement's arrival) and tags its pushes with the job's step and
generation, in every mode:

- A tagged push joins the round of its **step** (not of its count of pushes),
  which is applied once every member of the current membership pushed for it;
  a silent member is not dropped from it by the heartbeat timeout, only by a
  new membership. A push for a step already applied on the key is ignored:
  the survivors train a failed step again, and a key whose round was applied
  before the death keeps that update (the redo's gradient is the same global
  batch's).
- What a complete round applies: under sync the sum of its pushes, one
  update; under async and ssp each push on its own, in the order of the
  worker ids (a skip push: nothing), as untagged pushes are applied. The
  pushes of a step are held until the last member's arrives, so a step of a
  key is applied from one membership's pushes, whole, or not at all: each
  sample of the global batch reaches the key once. (The job's workers wait
  for each other at every step anyway: a step ends once every worker's
  pushes were accepted.)
- A new membership (a higher generation) drops the rounds not applied yet
  (the survivors push that step again, split over themselves), takes the
  missing workers out of rounds and staleness for good (a late message of a
  dead worker neither rejoins it nor joins a round), and ignores every push
  tagged with an older generation (one still on its way from before). A
  member new to the job (a replacement, with a worker id of its own) counts
  from then on: at the steps each key has applied, so its first push joins
  the next step's round and ssp's staleness does not wait for its past.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from gradhub.errors import InvalidOptionError

log = logging.getLogger(__name__)

MODES = ("async", "sync", "ssp")


@dataclass
class _Round:
    """The pushes of one round of a key not applied yet."""

    total: torch.Tensor | None = None
    """Summed rounds (sync): the sum of the pushes so far."""
    contributors: set[int] = field(default_factory=set)
    parts: dict[int, torch.Tensor] = field(default_factory=dict)
    """Rounds of pushes applied one by one (tagged async, ssp): each worker's push."""

    def add(self, worker: int, grad: torch.Tensor, *, summed: bool, skip: bool) -> None:
        """Take ``worker``'s push (a copy: ``grad`` may be the store's small-push
        tensor, refilled by the next push, ParameterStore.small_grad)."""
        self.contributors.add(worker)
        if not summed:
            if not skip:
                self.parts[worker] = grad.clone()
            return
        if skip:
            grad = torch.zeros_like(grad)
        if self.total is None:
            self.total = grad.clone()
        else:
            self.total += grad

    def updates(self) -> list[torch.Tensor]:
        """What the complete round applies, in order."""
        if self.total is not None:
            return [self.total]
        return [self.parts[w] for w in sorted(self.parts)]


class Consistency:
    """Step, round and membership accounting for one server (single-threaded use)."""

    def __init__(self, mode: str, *, workers: int, max_staleness: int = 0):
        if mode not in MODES:
            raise InvalidOptionError(
                f"unknown consistency mode {mode!r}; choose one of {', '.join(MODES)}"
            )
        self.mode = mode
        self.workers = workers
        self.max_staleness = max_staleness
        self.registered: set[int] = set()
        self.heard: set[int] = set()  # every worker id that sent anything (this process)
        self.live: set[int] = set()
        self.last_seen: dict[int, float] = {}
        self.steps: dict[str, dict[int, int]] = {}  # key -> worker -> step
        self.rounds_applied: dict[str, int] = {}
        self.pending: dict[str, dict[int, _Round]] = {}
        self.generation = 0  # the last membership a surviving job told (set_members)
        self.left: set[int] = set()  # workers a membership left out: never live again
        self.applied_step: dict[str, int] = {}  # key -> its last applied step (tagged pushes)

    # -- membership ---------------------------------------------------------
    def seen(self, worker: int, *, pushing: bool = False, now: float | None = None) -> bool:
        """Record that ``worker`` spoke; True when it joined or rejoined.

        A worker joins with its first push (a process that only inits and
        pulls, such as a driver, never counts); after that, any message keeps
        it live and brings it back after a drop.
        """
        self.heard.add(worker)
        if worker in self.left or (worker not in self.registered and not pushing):
            return False
        self.last_seen[worker] = time.monotonic() if now is None else now
        if worker in self.live:
            return False
        rejoin = worker in self.registered
        self.registered.add(worker)
        self.live.add(worker)
        if rejoin:
            for key, steps in self.steps.items():
                floor = self._rejoin_floor(key, worker)
                steps[worker] = max(steps.get(worker, 0), floor)
            log.info("worker %d rejoined", worker)
        else:
            log.info("worker %d joined (%d of %d)", worker, len(self.registered), self.workers)
        return True

    def _rejoin_floor(self, key: str, worker: int) -> int:
        if self.mode == "sync":
            return self.rounds_applied.get(key, 0)
        others = [s for w, s in self.steps[key].items() if w in self.live and w != worker]
        return min(others, default=0)

    def expire(self, timeout: float, now: float | None = None) -> list[int]:
        """Drop the live workers silent for more than ``timeout`` seconds; returns them."""
        now = time.monotonic() if now is None else now
        dropped = [w for w in sorted(self.live) if now - self.last_seen.get(w, now) > timeout]
        for w in dropped:
            self.live.discard(w)
            log.warning(
                "worker %d silent for more than %gs: dropped from %s accounting",
                w,
                timeout,
                self.mode,
            )
        return dropped

    # -- pushes and pulls ---------------------------------------------------
    def forget_key(self, key: str) -> None:
        self.steps.pop(key, None)
        self.rounds_applied.pop(key, None)
        self.pending.pop(key, None)
        self.applied_step.pop(key, None)

    def push(
        self,
        worker: int,
        key: str,
        grad: torch.Tensor,
        *,
        skip: bool = False,
        step: int | None = None,
        generation: int | None = None,
    ) -> list[torch.Tensor] | None:
        """Account for one push; returns the gradients to apply now, in order, or
        ``None`` where the push is ignored (see the module docstring).

        ``skip``: a skip push (its step was skipped by a loss scaler): it
        advances the worker's step and contributes nothing (async, ssp:
        nothing to apply; sync: it joins its round as zeros). ``step`` and
        ``generation``: a surviving job's tags (sync: the round is the step's).
        """
        if generation is not None and generation < self.generation:
            return None  # made before the last membership: its step is trained again
        if worker in self.left and (self.mode == "sync" or step is not None):
            return None
        steps = self.steps.setdefault(key, {})
        if step is not None:
            return self._push_step(worker, key, grad, step, skip)
        if self.mode != "sync":
            steps[worker] = steps.get(worker, 0) + 1
            return [] if skip else [grad]
        applied = self.rounds_applied.setdefault(key, 0)
        rnd = max(steps.get(worker, 0), applied)
        steps[worker] = rnd + 1
        self.pending.setdefault(key, {}).setdefault(rnd, _Round()).add(
            worker, grad, summed=True, skip=skip
        )
        return self.complete_rounds(key)

    def _push_step(
        self, worker: int, key: str, grad: torch.Tensor, step: int, skip: bool
    ) -> list[torch.Tensor] | None:
        """A tagged push: it joins the round of ``step``."""
        if step <= self.applied_step.setdefault(key, -1):
            return None  # that step of the key is applied: a redo keeps the first update
        rnd = self.pending.setdefault(key, {}).setdefault(step, _Round())
        if worker in rnd.contributors:
            return None  # one push per worker and step
        rnd.add(worker, grad, summed=self.mode == "sync", skip=skip)
        steps = self.steps[key]
        steps[worker] = steps.get(worker, 0) + 1
        return self.complete_rounds(key)

    def _complete_steps(self, key: str) -> list[torch.Tensor]:
        """The tagged rounds of ``key`` that every member has pushed for, in step order."""
        out: list[torch.Tensor] = []
        rounds = self.pending.get(key, {})
        members = self.registered - self.left
        missing = max(0, self.workers - len(self.registered))
        while rounds and not missing:
            step = min(rounds)
            if not members <= rounds[step].contributors:
                break
            out += rounds.pop(step).updates()
            self.applied_step[key] = step
            self.rounds_applied[key] = self.rounds_applied.get(key, 0) + 1
        return out

    def set_members(self, members: list[int], generation: int) -> bool:
        """A surviving job's membership ``generation``: ``members`` are its workers
        from now on (see the module docstring). False if it is not newer than the
        last one told (the same message again)."""
        if generation <= self.generation:
            return False
        self.generation = generation
        live = set(members)
        joining = live - self.registered  # a replacement: at the applied steps
        self.left |= (self.registered | self.live) - live
        self.left -= live
        self.registered |= live
        self.live = set(live)
        self.workers = len(live)
        now = time.monotonic()
        for w in live:
            self.last_seen[w] = now
        for key, rounds in self.pending.items():  # sync rounds and tagged ones
            rounds.clear()
            steps = self.steps.get(key, {})
            for w in steps:  # their pushes of the dropped rounds no longer count
                steps[w] = min(steps[w], self.rounds_applied.get(key, 0))
        for key, steps in self.steps.items():
            steps.update(dict.fromkeys(joining, self.rounds_applied.get(key, 0)))
        log.info(
            "membership %d: workers %s (left: %s)", generation, sorted(live), sorted(self.left)
        )
        return True

    def complete_rounds(self, key: str) -> list[torch.Tensor]:
        """What the rounds of ``key`` that are now complete apply, in order (sync
        rounds, and tagged ones in every mode)."""
        if key in self.applied_step:
            return self._complete_steps(key)
        if self.mode != "sync":
            return []
        out: list[torch.Tensor] = []
        rounds = self.pending.get(key, {})
        missing = max(0, self.workers - len(self.registered))
        while True:
            applied = self.rounds_applied.get(key, 0)
            rnd = rounds.get(applied)
            if rnd is None or missing or not self.live <= rnd.contributors:
                return out
            out += rounds.pop(applied).updates()
            self.rounds_applied[key] = applied + 1

    def pull_ready(self, worker: int, key: str) -> bool:
        """Whether a pull of ``key`` by ``worker`` may be answered now."""
        if self.mode == "async":
            return True
        steps = self.steps.get(key, {})
        mine = steps.get(worker, 0)
        if self.mode == "sync" and key in self.applied_step:  # tagged: its rounds applied
            return not any(worker in r.contributors for r in self.pending.get(key, {}).values())
        if self.mode == "sync":
            return self.rounds_applied.get(key, 0) >= mine
        others = [s for w, s in steps.items() if w in self.live]
        others += [0] * (
            len(self.live - steps.keys()) + max(0, self.workers - len(self.registered))
        )
        return mine - min(others, default=mine) <= self.max_staleness

    def waiting_for(self, worker: int, key: str) -> str:
        """Whom a pull of ``key`` by ``worker`` waits for, in words: the ids of the
        live workers behind, and of those heard from that never pushed (a driver
        that only inits and pulls is listed there too); a worker that never sent
        anything has no id the server could know, so it is counted."""
        never = self._never_pushed()
        steps = self.steps.get(key, {})
        if self.mode == "sync":
            rounds = self.pending.get(key, {})
            rnd, waits = self.rounds_applied.get(key, 0), self.live
            if key in self.applied_step:  # tagged: the oldest step, waiting for every member
                rnd = min(rounds, default=self.applied_step[key] + 1)
                waits = self.registered - self.left
            pending = rounds.get(rnd)
            done = pending.contributors if pending is not None else set()
            late = [str(w) for w in sorted(waits - done)]
            what = f"sync {'step' if key in self.applied_step else 'round'} {rnd} of {key!r}"
        else:
            mine = steps.get(worker, 0)
            behind = sorted(w for w in self.live if steps.get(w, 0) < mine - self.max_staleness)
            late = [f"{w} (at step {steps.get(w, 0)})" for w in behind]
            what = f"worker {worker} at step {mine} of {key!r} (max_staleness={self.max_staleness})"
        whom = " and ".join(x for x in (f"worker(s) {', '.join(late)}" if late else "", never) if x)
        return f"{what} waits for {whom or 'no live worker'}"

    def _never_pushed(self) -> str:
        """The workers still missing for ``workers`` to have registered, in words."""
        unjoined = max(0, self.workers - len(self.registered))
        if not unjoined:
            return ""
        quiet = sorted(self.heard - self.registered)
        unknown = max(0, unjoined - len(quiet))
        parts = [f"{_named(quiet)} (heard from, never pushed)"] if quiet else []
        parts += [f"{_counted(unknown)} never heard from"] if unknown else []
        pushed = _named(sorted(self.registered)) if self.registered else "none"
        return (
            f"{_counted(unjoined)} that never pushed: {' and '.join(parts)} (the server "
            f"waits for {_counted(self.workers)}; pushed so far: {pushed})"
        )

    def tracked_keys(self) -> list[str]:
        return list(self.steps)

    # -- checkpoints --------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "registered": sorted(self.registered),
            "steps": {k: dict(v) for k, v in self.steps.items()},
            "rounds_applied": dict(self.rounds_applied),
            "generation": self.generation,
            "left": sorted(self.left),
            "applied_step": dict(self.applied_step),
            "pending": {
                k: {r: (p.total, sorted(p.contributors), p.parts) for r, p in rounds.items()}
                for k, rounds in self.pending.items()
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore accounting; workers count as live again until they miss heartbeats."""
        now = time.monotonic()
        self.registered = set(state["registered"])
        self.generation = int(state.get("generation", 0))
        self.left = set(state.get("left", ()))
        self.applied_step = dict(state.get("applied_step", {}))
        if self.generation:
            self.workers = len(self.registered - self.left)
        self.live = self.registered - self.left
        self.last_seen = dict.fromkeys(self.live, now)
        self.steps = {k: dict(v) for k, v in state["steps"].items()}
        self.rounds_applied = dict(state["rounds_applied"])
        self.pending = {  # a round of an older checkpoint: (total, contributors)
            k: {
                int(r): _Round(p[0], set(p[1]), dict(p[2] if len(p) > 2 else {}))
                for r, p in rounds.items()
            }
            for k, rounds in state["pending"].items()
        }

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "workers": self.workers,
            "registered": sorted(self.registered),
            "live": sorted(self.live),
            "generation": self.generation,
            "left": sorted(self.left),
            "rounds_applied": dict(self.rounds_applied),
            # key -> worker id (a string: the report is JSON) -> its step on the key
            "steps": {k: {str(w): n for w, n in v.items()} for k, v in self.steps.items()},
        }


def _ids(workers: list[int]) -> str:
    return ", ".join(str(w) for w in workers)


def _named(workers: list[int]) -> str:
    """Worker ids in words: ``worker 5``, ``workers 0, 1``."""
    return f"worker{'s' if len(workers) != 1 else ''} {_ids(workers)}"


def _counted(n: int) -> str:
    """A number of workers in words (``1 worker``, ``3 workers``), never an id."""
    return f"{n} worker{'s' if n != 1 else ''}"
