"""Who is in a surviving job now, and the group rebuilt over the survivors.

``gradhub run --survive`` (:mod:`gradhub.cli.supervisor`) starts every worker
on its own, hosts the job's c10d store in the launcher's process (which
outlives every worker) and keeps the membership there. A worker's death ends
only that worker; the others go on:

- **The record.** Generation ``g`` of the job is the list of its live
  members, in rank order, under ``gradhub/survive/members/<g>`` (JSON: the
  member ids, which are the ranks of generation 0; a replacement gets a new
  id), and ``gradhub/survive/dead/<g>`` the members that left since ``g - 1``.
  Only the supervisor writes them: it is the parent of every worker on its
  host and sees a death the moment it happens (``waitpid``; other nodes'
  launchers report theirs), so no worker has to guess whether a silent peer
  is dead or slow. Workers write only their own keys: that they arrived for
  a generation's group, and (a replacement) that they are ready to join.
- **Noticing.** A survivor learns of a death from its transport: shared
  memory checks every peer's ``pidfd`` each 0.1 s of a wait
  (:mod:`gradhub.transports.shm_control`), and a socket to a dead process
  closes at once (gloo, the ring). A survivor that leaves a group for
  another's death aborts that group's gloo connections
  (``ProcessGroup.abort``), so a survivor still waiting on it fails within
  moments too, not at the collective timeout.
- **Rebuilding** (:func:`rebuild`, from :meth:`gradhub.Runtime.regroup`): the
  old group is aborted and destroyed, the survivor waits for the next
  generation's record, the members of that generation gather in the store
  (:func:`arrive`: a death meanwhile brings a newer generation, which
  supersedes this one, instead of a wait for the dead member until the
  timeout), and the default process group is set up again over them, each
  rank the member's index there (dense, in the old order),
  on the same store under ``gradhub/gen<g>/`` (fresh keys for gloo's
  rendezvous and the check-ins), with a new
  :class:`~gradhub.transports.group.CollectiveGroup` (new shared-memory
  segments; the old ones are freed with their last mapping).
- **Joining.** A watcher thread waits (in the kernel, on a store connection
  of its own) for the next generation's record; :attr:`Membership.pending`
  then asks, through the step's flags, for a regroup after the current step
  on every rank: how a ready replacement is taken in at a step boundary.
  The replacement then takes the survivors' state (:class:`Regrouped`).
- **Too few.** A generation with fewer members than ``--min-workers`` is
  recorded with ``gradhub/survive/stop/<g>``; each survivor then raises
  :class:`~gradhub.errors.TooFewWorkersError` naming the dead members.
- The store's host is the one point that must not die: if the launcher's
  process dies, the workers' next store access fails and they stop with
  :class:`~gradhub.errors.WorkerFailedError` naming the store (a whole-job
  restart from checkpoints covers that case).
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from gradhub.errors import (
    LaunchEnvironmentError,
    MembershipChangedError,
    RendezvousError,
    TooFewWorkersError,
    WorkerFailedError,
)
from gradhub.runtime.setup import _start, _tcp_client
from gradhub.transports.c10d_errors import first_line, is_timeout
from gradhub.transports.group import CollectiveGroup

log = logging.getLogger(__name__)

PREFIX = "gradhub/survive/"
"""Where the membership lives in the job's store."""

SURVIVE_ENV = "GRADHUB_SURVIVE"
"""Set to ``1`` by ``gradhub run --survive`` in every worker's environment."""

MEMBER_ENV = "GRADHUB_MEMBER"
"""A worker's member id (its rank in generation 0; a replacement's new id)."""

JOINING_ENV = "GRADHUB_JOINING"
"""``1`` in a replacement: it joins a running job instead of generation 0."""


def members_key(generation: int) -> str:
    return f"{PREFIX}members/{generation}"


def dead_key(generation: int) -> str:
    return f"{PREFIX}dead/{generation}"


def stop_key(generation: int) -> str:
    return f"{PREFIX}stop/{generation}"


def ready_key(member: int) -> str:
    """Set by a replacement once it can join (the supervisor then adds it)."""
    return f"{PREFIX}ready/{member}"


LATEST = f"{PREFIX}latest"
"""The newest generation's number."""


def group_prefix(generation: int) -> str:
    """The store prefix of generation ``generation``'s process group."""
    return f"gradhub/gen{generation}/"


def publish(
    store: dist.Store,
    generation: int,
    members: list[int],
    dead: list[int],
    *,
    stop: bool = False,
) -> None:
    """Write generation ``generation`` (the supervisor's side). The members
    key comes last: a worker waiting for it finds the rest written."""
    store.set(dead_key(generation), json.dumps(dead))
    if stop:
        store.set(stop_key(generation), "1")
    store.set(members_key(generation), json.dumps(members))
    store.set(LATEST, str(generation))
    for member in members:  # wakes each member's watcher (Membership.watch)
        store.set(notify_key(member, generation), "1")


def notify_key(member: int, generation: int) -> str:
    """What ``member``'s watcher waits for: generation ``generation`` is out (or
    the member is closing)."""
    return f"{PREFIX}notify/{member}/{generation}"


@dataclass
class Generation:
    """One membership record."""

    number: int
    members: list[int]
    """Member ids in rank order."""
    dead: list[int]
    """Members that left since the previous generation."""
    stop: bool
    """Fewer members than the job's minimum: the job ends."""


WATCH_SLICE = 3600.0
"""Seconds of one wait of the watcher (it waits again after each; closing wakes it)."""

WATCH_JOIN = 5.0
"""Seconds :meth:`Membership.close` waits for the woken watcher to end."""


class Membership:
    """This worker's view of a surviving job's membership (see the module docstring)."""

    def __init__(self, store: dist.Store, member: int, timeout: float) -> None:
        self.store = store
        """The job's store itself (not a generation's prefix)."""
        self.member = member
        self.timeout = timeout
        self.generation = 0
        self.dead: list[int] = []
        """Every member that has left the job, in the order they left."""
        self._seen = 0
        self._closing = False
        self._thread: threading.Thread | None = None

    def watch(self, store: dist.Store) -> None:
        """Start the watcher thread (once this member's generation is known), on
        ``store``, a connection of its own: a blocking wait would hold the one the
        collectives check in on."""
        self._thread = threading.Thread(
            target=self._watch, args=(store,), name="gradhub-membership", daemon=True
        )
        self._thread.start()
        # A thread still inside a store call when the interpreter exits aborts the
        # process (c10d's objects are destroyed under it): stop it first.
        atexit.register(self.close)

    def close(self) -> None:
        """Stop the watcher thread: wake it with its own notify keys, then join it.
        Idempotent."""
        self._closing = True
        thread, self._thread = self._thread, None
        if thread is None or thread is threading.current_thread():
            return
        try:
            for generation in range(self.generation + 1, max(self._seen, self.generation) + 3):
                self.store.set(notify_key(self.member, generation), "1")
        except RuntimeError as exc:  # the store's host is gone: so is the thread's wait
            log.debug("[member %d] cannot wake the membership watch: %s", self.member, exc)
        thread.join(WATCH_JOIN)

    @property
    def pending(self) -> bool:
        """Whether the store holds a newer generation than this rank's (a replacement
        is ready to join, or a worker died): the next step boundary regroups."""
        return self._seen > self.generation

    def _watch(self, store: dist.Store) -> None:
        """Wait, in the kernel, for each next generation's record; on a connection
        of its own (a blocking wait would hold the one the collectives check in on)."""
        while not self._closing:
            after = max(self._seen, self.generation) + 1
            try:
                store.wait([notify_key(self.member, after)], timedelta(seconds=WATCH_SLICE))
            except RuntimeError as exc:  # c10d: the wait timed out, or the store is gone
                if is_timeout(exc):
                    continue
                log.debug("[member %d] membership watch ends: %s", self.member, exc)
                return
            if not self._closing:
                self._seen = after

    def read(self, generation: int, timeout: float | None = None) -> Generation:
        """Generation ``generation``'s record, waiting for it at most ``timeout``
        seconds (default: the job's timeout)."""
        limit = self.timeout if timeout is None else timeout
        key = members_key(generation)
        try:
            self.store.wait([key], timedelta(seconds=limit))
            members = json.loads(self.store.get(key))
            dead = json.loads(self.store.get(dead_key(generation)))
            stop = self.store.check([stop_key(generation)])
        except RuntimeError as exc:  # c10d: the store's host is gone, or the wait timed out
            raise WorkerFailedError(
                f"[member {self.member}] the job's membership record {generation} did not "
                f"come within {limit:g}s ({first_line(exc)}): the "
                "launcher (gradhub run --survive), which hosts it, died or no worker died"
            ) from exc
        return Generation(generation, list(members), list(dead), bool(stop))

    def next(self) -> Generation:
        """The generation after the current one (waits for the supervisor to
        record it); raises :class:`TooFewWorkersError` if it ends the job."""
        record = self.read(self.generation + 1)
        self.generation = record.number
        self.dead += record.dead
        if record.stop:
            raise TooFewWorkersError(record.dead, self.dead, len(record.members))
        if self.member not in record.members:
            raise WorkerFailedError(
                f"[member {self.member}] this worker is not in the job's generation "
                f"{record.number} (members {record.members}): the launcher counted it dead"
            )
        return record


def abandon(group: CollectiveGroup, reason: str) -> None:
    """Leave ``group`` for good after a peer's death: later operations on it
    are refused, and its gloo connections are aborted so that a survivor still
    waiting on this rank fails now (see the module docstring)."""
    group.mark_broken(reason, peer=True)
    try:
        group.process_group.abort()
    except RuntimeError as exc:  # a backend without abort: its peers time out
        log.debug("[rank %d] cannot abort the process group: %s", group.rank, exc)


def join(
    environ: Mapping[str, str],
    member: int,
    backend: str,
    timeout: float,
    transport: str | None,
) -> tuple[Membership, CollectiveGroup, Regrouped | None]:
    """A surviving worker joins generation 0: the store the launcher hosts at
    ``MASTER_ADDR:MASTER_PORT``, the first membership record, the group. A
    replacement joins the generation that takes it in, and agrees with the
    survivors on the step to continue from (the :class:`Regrouped` its
    strategy then takes their state by, at set-up)."""
    try:
        host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    except (KeyError, ValueError) as exc:
        raise LaunchEnvironmentError(
            f"a surviving worker needs MASTER_ADDR and MASTER_PORT ({exc} is missing or "
            "wrong)\n- help: start the job with `gradhub run -n N --survive script.py`"
        ) from exc
    store = _tcp_client(host, port, member, timeout)
    membership = Membership(store, member, timeout)
    if environ.get(JOINING_ENV) != "1":
        record = membership.read(0)
        while True:
            try:
                group = rebuild(membership, record, backend, timeout, transport)
            except MembershipChangedError:  # a worker died before the first group was up
                record = membership.next()
                continue
            membership.watch(_tcp_client(host, port, member, timeout))
            return membership, group, None
    # A replacement: say it is ready, then wait for the generation that takes it in.
    store.set(ready_key(member), "1")
    generation = int(store.get(LATEST))
    while member not in (record := membership.read(generation)).members:
        generation += 1
    while True:
        membership.generation = membership._seen = generation
        try:
            group = rebuild(membership, record, backend, timeout, transport)
        except MembershipChangedError:
            generation += 1
            record = membership.read(generation)
            continue
        membership.watch(_tcp_client(host, port, member, timeout))
        return membership, group, Regrouped.agree(group, record, 0)


def rebuild(
    membership: Membership,
    record: Generation,
    backend: str,
    timeout: float,
    transport: str | None,
) -> CollectiveGroup:
    """The default process group over ``record``'s members (this member's rank:
    its index there), on the job's store under the generation's own prefix."""
    arrive(membership, record)
    store = dist.PrefixStore(group_prefix(record.number), membership.store)
    rank = record.members.index(membership.member)
    size, bound = len(record.members), min(timeout, RENDEZVOUS)
    try:
        return _start(store, rank, size, backend, timeout, rank, transport, rendezvous=bound)
    except RendezvousError:
        # Every member had arrived: a member that died since is the likely cause.
        newer = members_key(record.number + 1)
        deadline = time.monotonic() + SUPERSEDED_WAIT
        while time.monotonic() < deadline:
            if membership.store.check([newer]):
                raise MembershipChangedError(
                    f"generation {record.number + 1} came during {record.number}'s rendezvous"
                ) from None
            time.sleep(ARRIVAL_POLL)
        raise


RENDEZVOUS = 10.0
"""Seconds the process group's own rendezvous of a generation may take. Every
member has arrived first (:func:`arrive`), so a longer one is a member that
died in it, whose death brings the next generation: not a wait for the
operation timeout."""

SUPERSEDED_WAIT = 5.0
"""Seconds a rendezvous that ran out of time waits for the next generation
before its error stands."""


ARRIVAL_POLL = 0.02
"""Seconds between two looks at who has arrived for a generation's group."""


def arrive(membership: Membership, record: Generation) -> None:
    """Wait until every member of ``record`` has said it is here, before the
    process group's own rendezvous (which would wait for a dead member until
    the timeout). A newer generation meanwhile raises :class:`MembershipChangedError`."""
    store, number = membership.store, record.number
    store.set(f"{PREFIX}arrived/{number}/{membership.member}", "1")
    keys = [f"{PREFIX}arrived/{number}/{m}" for m in record.members]
    deadline = time.monotonic() + membership.timeout
    while not store.check(keys):
        if store.check([members_key(number + 1)]):
            raise MembershipChangedError(f"generation {number + 1} came while {number} gathered")
        if time.monotonic() > deadline:
            missing = [m for m, k in zip(record.members, keys, strict=True) if not store.check([k])]
            raise WorkerFailedError(
                f"[member {membership.member}] member(s) {missing} did not arrive for "
                f"generation {number} within {membership.timeout:g}s"
            )
        time.sleep(ARRIVAL_POLL)


@dataclass
class Regrouped:
    """What the survivors agreed on after a rebuild."""

    generation: int
    members: list[int]
    dead: list[int]
    committed_steps: int
    """The most steps any survivor applied: every rank continues from there."""
    source: int
    """The lowest rank that applied them: the ranks behind take its state."""
    behind: list[int] = field(default_factory=list)
    """Ranks that applied fewer steps (a peer died while the last step's results
    were reaching them): they take the source's state (the listeners' job)."""
    steps: list[int] = field(default_factory=list)
    """Per rank of the new group, the steps it applied (a replacement: none)."""

    @classmethod
    def agree(cls, group: CollectiveGroup, record: Generation, committed: int) -> Regrouped:
        steps = [v[0] for v in group.all_gather_ints([committed], "regroup: committed steps")]
        best = max(steps)
        return cls(
            record.number,
            record.members,
            record.dead,
            best,
            steps.index(best),
            [r for r, n in enumerate(steps) if n < best],
            steps,
        )


@dataclass(frozen=True)
class BatchShare:
    """One rank's share of one global batch, as a global-batch sampler handed it out."""

    generation: int
    """The membership generation it was split for."""
    step: int | None
    """The committed-step count at which it is to be trained (``None``: a
    placeholder that only keeps a prefetching loader going, never trained)."""
    samples: int
    global_samples: int

    def current(self, generation: int, committed_steps: int) -> bool:
        """Whether it is the batch to train now (else a failure or a peer's
        step made it stale: trained locally, never sent nor applied)."""
        return self.generation == generation and self.step == committed_steps
