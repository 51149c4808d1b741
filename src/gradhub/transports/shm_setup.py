"""Setting up the shared-memory transport: who takes part, and the segments handed round.

The lowest rank of the host (the leader) listens on an abstract-namespace
Unix socket whose random name it publishes in the group's c10d store; the
other ranks connect, say who they are (rank and pid, checked against the
socket's peer credentials), and receive the table of pids and the control
segment's descriptor (``SCM_RIGHTS``). Later segments (the data segment as
it grows) travel the same way. Every failure here is a gradhub error naming
the rank: ``died(index, during)`` and ``timed_out(ranks)`` make them.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gradhub._shm.hosts import wait_for_keys
from gradhub._shm.memory import Mapping, new_segment, recv_exact
from gradhub.errors import CollectiveTimeoutError, WorkerFailedError
from gradhub.transports.group import CollectiveGroup
from gradhub.transports.operation import Operation

_HELLO = struct.Struct("<qq")  # rank, pid
_GROW = struct.Struct("<q")  # bytes of the segment

Died = Callable[[int, str], WorkerFailedError]
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


def _died_of(
    group: CollectiveGroup, op: Operation, ranks: Sequence[int], index: int
) -> WorkerFailedError:
    group.mark_broken(f"{op.name} failed")
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
