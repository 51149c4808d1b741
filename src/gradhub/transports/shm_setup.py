"""Setting up the shared-memory transport: who takes part, and the segments handed round.

The lowest rank of the host (the leader) listens on an abstract-namespace
Unix socket whose random name it publishes in the group's c10d store; the
other ranks connect, say who they are (rank and pid, checked against the
socket's peer credentials), and receive the table of pids and the control
segment's descriptor (``SCM_RIGHTS``). Later segments (the data segment as
it grows, and the vectors read in place: :class:`SharedVectors`) travel
the same way. Every failure here is a gradhub error naming
the rank: ``died(index, during)`` and ``timed_out(ranks)`` make them.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from gradhub._shm.hosts import wait_for_keys
from gradhub._shm.memory import Mapping, new_segment, recv_exact
from gradhub.errors import CollectiveTimeoutError, StateError, WorkerFailedError
from gradhub.transports.group import CollectiveGroup
from gradhub.transports.operation import Operation
from gradhub.transports.stores import gave_up

_log = logging.getLogger("gradhub.collective")

_HELLO = struct.Struct("<qq")  # rank, pid
_GROW = struct.Struct("<q")  # bytes of the segment

Died = Callable[[int, str], WorkerFailedError | CollectiveTimeoutError]
"""``died(local index, during)``: the error for a peer that is gone."""
TimedOut = Callable[[list[int]], CollectiveTimeoutError]
"""``timed_out(group ranks)``: the error for peers that did not come in time."""
Late = Callable[[int], CollectiveTimeoutError]
"""``late(local index)``: the error for a peer late in an operation."""


@dataclass
class Joined:
    """This rank's links to the other ranks of its host."""

    peers: dict[int, socket.socket] = field(default_factory=dict)
    """Local index -> socket (the leader: every other rank; the others: the leader, 0)."""
    pids: list[int] = field(default_factory=list)
    """Every local rank's pid, by local index."""
    control: Mapping | None = None

    def close(self) -> None:
        for conn in self.peers.values():
            conn.close()
        self.peers.clear()


def join(
    group: CollectiveGroup,
    ranks: Sequence[int],
    op: Operation,
    key: str,
    control_bytes: int,
    died: Died,
    timed_out: TimedOut,
) -> Joined:
    """Connect the ranks of ``ranks`` (ascending; this rank among them) and map
    the control segment of ``control_bytes``. On an error the caller closes
    what ``joined`` holds (it is filled as it goes)."""
    joined = Joined()
    try:
        if ranks.index(group.rank) == 0:
            _lead(group, ranks, op, key, control_bytes, joined, timed_out)
        else:
            _follow(group, ranks, op, key, control_bytes, joined, died, timed_out)
    except BaseException:
        joined.close()
        raise
    return joined


def _lead(
    group: CollectiveGroup,
    ranks: Sequence[int],
    op: Operation,
    key: str,
    control_bytes: int,
    joined: Joined,
    timed_out: TimedOut,
) -> None:
    store = group.store
    assert store is not None
    size = len(ranks)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        address = f"\0gradhub-shm-{secrets.token_hex(12)}"
        listener.bind(address)
        listener.listen(size)
        store.set(f"{key}/socket", address[1:])
        fd = new_segment(control_bytes, "gradhub-control")
        try:
            pids = {0: os.getpid()}
            while len(pids) < size:
                listener.settimeout(max(op.remaining(), 0.001))
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    raise timed_out([ranks[i] for i in range(size) if i not in pids]) from None
                conn.settimeout(max(op.remaining(), 0.001))
                try:
                    rank, pid = _HELLO.unpack(recv_exact(conn, _HELLO.size))
                except (OSError, ConnectionError):
                    conn.close()
                    continue  # a peer that died half-way; its absence is named above
                creds = conn.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
                )
                peer_pid, peer_uid, _ = struct.unpack("3i", creds)
                if rank not in ranks or peer_pid != pid or peer_uid != os.getuid():
                    conn.close()
                    raise WorkerFailedError(
                        f"[rank {group.rank}] {op.name}: an unexpected process "
                        f"(pid {peer_pid}) joined the shared-memory set-up as rank {rank}"
                    )
                index = ranks.index(rank)
                joined.peers[index], pids[index] = conn, pid
            joined.pids = [pids[i] for i in range(size)]
            table = struct.pack(f"<{size}q", *joined.pids)
            for index, conn in joined.peers.items():
                try:
                    socket.send_fds(conn, [table], [fd])
                except OSError:
                    raise _died_of(group, op, ranks, index) from None
            joined.control = Mapping(os.dup(fd), control_bytes)
        finally:
            os.close(fd)
    finally:
        listener.close()


def late_error(
    group: CollectiveGroup, op: Operation, behind: list[int], waited_on: int
) -> CollectiveTimeoutError:
    """``op`` ran out of time on this rank waiting on rank ``waited_on``;
    ``behind``: the ranks that had not entered it. Breaks the group."""
    group.mark_broken(f"{op.name} timed out", peer=True)
    detail = f"not entered the operation; rank {group.rank} was waiting on rank {waited_on}"
    err = CollectiveTimeoutError(op.name, behind or [waited_on], op.timeout, detail)
    _log.error("[rank %d] %s", group.rank, err)
    return err


def died_error(
    group: CollectiveGroup, op: Operation, rank: int, pid: int | None, during: str
) -> WorkerFailedError | CollectiveTimeoutError:
    """Rank ``rank`` (process ``pid``) died during ``during`` of ``op``. Breaks the group.
    A rank that ran out of time in ``op`` and then exited did not die: the error is
    then the timeout, naming whom it waited for (as a lost connection's is)."""
    if gave_up(group.store, op.sequence, rank):
        return group.timed_out(op, rank)
    group.mark_broken(f"{op.name} failed", peer=True)
    err = WorkerFailedError(
        f"[rank {group.rank}] {op.name}: rank {rank} (pid {'?' if pid is None else pid}) "
        f"died during {during} (shared memory). This group is unusable after it: a job "
        "started with `gradhub run --survive` goes on over the survivors; any other must "
        "be restarted"
    )
    _log.error("%s", err)
    return err


def _died_of(
    group: CollectiveGroup, op: Operation, ranks: Sequence[int], index: int
) -> WorkerFailedError:
    group.mark_broken(f"{op.name} failed", peer=True)
    return WorkerFailedError(
        f"[rank {group.rank}] {op.name}: rank {ranks[index]} left during the "
        "shared-memory set-up. The group is unusable: stop this process and restart the job"
    )


def _follow(
    group: CollectiveGroup,
    ranks: Sequence[int],
    op: Operation,
    key: str,
    control_bytes: int,
    joined: Joined,
    died: Died,
    timed_out: TimedOut,
) -> None:
    store = group.store
    assert store is not None
    size = len(ranks)
    if not wait_for_keys(store, [f"{key}/socket"], op.remaining()):
        raise timed_out([ranks[0]])
    address = "\0" + store.get(f"{key}/socket").decode()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    joined.peers[0] = conn
    conn.settimeout(max(op.remaining(), 0.001))
    try:
        conn.connect(address)
        conn.sendall(_HELLO.pack(group.rank, os.getpid()))
        table, fds, _, _ = socket.recv_fds(conn, 8 * size, 1)
    except TimeoutError:
        raise timed_out([ranks[0]]) from None
    except OSError:  # refused, reset: the leader is gone
        raise died(0, "set-up") from None
    if len(fds) != 1 or len(table) != 8 * size:
        for fd in fds:
            os.close(fd)
        raise died(0, "set-up")
    joined.pids = list(struct.unpack(f"<{size}q", table))
    joined.control = Mapping(fds[0], control_bytes)


def share_segment(
    joined: Joined, leader: bool, op: Operation, total: int, died: Died, late: Late
) -> Mapping:
    """A new data segment: the leader makes one of ``total`` bytes and sends it
    to the others; they map what they receive (its ``size`` says how large)."""
    if leader:
        fd = new_segment(total, "gradhub-data")
        try:
            message = _GROW.pack(total)
            for i, conn in joined.peers.items():
                try:
                    socket.send_fds(conn, [message], [fd])
                except OSError:
                    raise died(i, "growing the shared segment") from None
            return Mapping(os.dup(fd), total)
        finally:
            os.close(fd)
    conn = joined.peers[0]
    conn.settimeout(max(op.remaining(), 0.001))
    try:
        message, fds, _, _ = socket.recv_fds(conn, _GROW.size, 1)
    except TimeoutError:
        raise late(0) from None
    except OSError:
        raise died(0, "growing the shared segment") from None
    if len(fds) != 1 or len(message) != _GROW.size:
        for fd in fds:
            os.close(fd)
        raise died(0, "growing the shared segment")
    (total,) = _GROW.unpack(message)
    return Mapping(fds[0], total)


class SharedVectors:
    """fp32 vectors that every rank of a host maps, one per rank, in one segment
    each (:meth:`ShmTransport.shared_vector <gradhub.transports.shm.ShmTransport.shared_vector>`).
    Each segment has a number (1, 2, ...: the same on every rank, as they are made
    collectively), by which a rank tells the others which vector it exposes.
    A segment is forgotten here when this rank's vector (the tensor object
    :meth:`make` returned) is garbage; its memory goes with the last view."""

    _ALIGN = 4096

    def __init__(self) -> None:
        self._segments: list[tuple[Mapping, list[torch.Tensor]] | None] = []
        self._ids: dict[int, int] = {}  # address of this rank's vector -> number

    def make(
        self, joined: Joined, index: int, op: Operation, numel: int, died: Died, late: Late
    ) -> torch.Tensor:
        """A new segment of one ``numel``-element vector per rank (collective);
        returns the vector of local rank ``index``."""
        nbytes = -(-max(numel * 4, 1) // self._ALIGN) * self._ALIGN
        size = len(joined.pids)
        mapping = share_segment(joined, index == 0, op, size * nbytes, died, late)
        assert mapping.bytes is not None
        views = [
            mapping.bytes[i * nbytes : i * nbytes + numel * 4].view(torch.float32)
            for i in range(size)
        ]
        self._segments.append((mapping, views))
        number, address = len(self._segments), views[index].data_ptr()
        self._ids[address] = number
        weakref.finalize(views[index], self._forget, number, address)
        return views[index]

    def _forget(self, number: int, address: int) -> None:
        if number <= len(self._segments):
            self._segments[number - 1] = None
            self._ids.pop(address, None)

    def id_of(self, flat: torch.Tensor, index: int) -> int:
        """The number of the segment whose vector of local rank ``index`` is
        ``flat`` (the whole of it, as fp32), else 0."""
        number = self._ids.get(flat.data_ptr(), 0) if self._ids else 0
        if number and self.vector(number, index).numel() != flat.numel():
            return 0
        return number if flat.dtype == torch.float32 else 0

    def vector(self, number: int, index: int) -> torch.Tensor:
        """Local rank ``index``'s vector of segment ``number``."""
        segment = self._segments[number - 1] if 0 < number <= len(self._segments) else None
        if segment is None:
            raise StateError(
                f"local rank {index} reads in place a shared vector this rank no longer "
                "has: the ranks do not run the same operations on the same objects"
            )
        return segment[1][index]

    def close(self) -> None:
        """Forget the vectors; a mapping stays until the caller's views of it go."""
        segments, self._segments = self._segments, []
        self._ids.clear()
        for segment in segments:
            if segment is not None:
                segment[0].close()
