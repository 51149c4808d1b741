"""Tensors a client lends its user: CPU tensors that lie in the client's arena
(:meth:`gradhub.RemoteParameterServer.empty_like`), so a push is read and a pull
written by a server on this host where they lie, with no copy on the client.

Each tensor is a segment of its own (an anonymous ``memfd``), mapped once in
this process. Its lifetime is the tensor's: the tensor's storage holds the
mapping (``torch.frombuffer``), so the memory stays mapped while any view of it
lives, and a weak-reference finalizer, run when the last one is gone, closes
the segment's descriptor and queues its id for every server that mapped it to
forget (sent by the client's I/O thread with its next request; a finalizer may
run in any thread, so it only queues). Closing the client leaves the tensors
what they are: ordinary CPU memory, valid until they are freed.

The rules that keep the user's memory exact (enforced by the client; the
arena's module docstring, :mod:`gradhub.ps.wire.arena`, says why each holds):

- A push reads the tensor until its future is done: do not change it before.
- A pull writes into the tensor once, when the server answers the first send
  of its request; a retry or a replay names a private segment instead (copied
  out by the client). A pull the client gives up on (its deadline) is
  cancelled first: the future fails only once the server confirmed that it
  will not write into the tensor for that request (any more).
- Overlapping requests are refused at the call (``StateError``): a pull into
  bytes that a push or pull in flight reads or writes, or a push of bytes a
  pull in flight writes.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from gradhub._shm.memory import new_segment
from gradhub.errors import ClosedError, StateError
from gradhub.ps.wire.arena import FIRST_SHARED_ID

__all__ = ["SharedSegment", "SharedTensors"]

F = TypeVar("F", bound=Future[None])


@dataclass(eq=False)
class SharedSegment:
    """One user tensor's segment: its id, size, descriptor (kept to hand it to every
    server it is used with) and a weak reference to its mapping."""

    id: int
    size: int
    fd: int
    base: int
    mapping: weakref.ref[mmap.mmap]
    busy: list[tuple[int, int, bool]] = field(default_factory=list)  # (start, end, writes)

    def view(self, offset: int, length: int) -> memoryview | None:
        """The mapped bytes ``[offset, offset + length)``, or ``None`` once freed."""
        mm = self.mapping()
        if mm is None or offset < 0 or offset + length > self.size:
            return None
        return memoryview(mm)[offset : offset + length]


class SharedTensors:
    """The user tensors of one client (thread-safe: callers, finalizers and the I/O thread)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._by_base: dict[int, SharedSegment] = {}
        self._by_id: dict[int, SharedSegment] = {}
        self._ids = itertools.count(FIRST_SHARED_ID)
        self._lock = threading.RLock()  # re-entrant: a finalizer may run inside a locked call
        self._freed: dict[int, deque[int]] = {}  # per arena listening: ids to forget
        self._closed = False

    # ----------------------------------------------------------------- user
    def empty(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A new tensor in a segment of its own (an ordinary one if not ``enabled``)."""
        if self._closed:
            raise ClosedError("this RemoteParameterServer is closed; create a new one")
        if not self.enabled:
            return torch.empty(shape, dtype=dtype)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        page = mmap.PAGESIZE
        size = max(page, (nbytes + page - 1) // page * page)
        fd = new_segment(size, "gradhub-ps-tensor")
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        raw = torch.frombuffer(mm, dtype=torch.uint8)  # its storage keeps ``mm`` mapped
        with self._lock:
            seg = SharedSegment(next(self._ids), size, fd, raw.data_ptr(), weakref.ref(mm))
            self._by_base[seg.base] = seg
            self._by_id[seg.id] = seg
        weakref.finalize(mm, self._freed_segment, seg)
        return raw[:nbytes].view(dtype).view(shape)

    def find(self, t: torch.Tensor) -> tuple[SharedSegment, int] | None:
        """(segment, byte offset) of ``t`` if it lies contiguously in one of these
        segments, else ``None`` (then it travels as any other tensor)."""
        if not self._by_base or t.layout != torch.strided or t.device.type != "cpu":
            return None
        if not t.is_contiguous():
            return None
        storage = t.untyped_storage()
        seg = self._by_base.get(storage.data_ptr())
        if seg is None or seg.mapping() is None:
            return None
        offset = t.data_ptr() - seg.base
        if offset < 0 or offset + t.numel() * t.element_size() > seg.size:
            return None
        return seg, offset

    def by_id(self, sid: int) -> SharedSegment | None:
        return self._by_id.get(sid)

    def claim(self, t: torch.Tensor, *, writes: bool, what: str) -> Callable[[], None] | None:
        """Mark the bytes of ``t`` as read (a push) or written (a pull) by a request
        until the returned release is called; ``StateError`` if they overlap a
        request in flight that writes them, or (``writes``) that reads them.
        ``None`` when ``t`` is not one of these tensors."""
        found = self.find(t)
        if found is None:
            return None
        seg, offset = found
        entry = (offset, offset + t.numel() * t.element_size(), writes)
        with self._lock:
            for start, end, other_writes in seg.busy:
                if start < entry[1] and entry[0] < end and (writes or other_writes):
                    doing = "a pull writes into" if other_writes else "a push reads"
                    raise StateError(
                        f"{what}: {doing} this shared tensor's memory and is not done\n"
                        "- help: wait for that request's future first, or use another "
                        "tensor (RemoteParameterServer.empty_like)"
                    )
            seg.busy.append(entry)

        def release() -> None:
            with self._lock, contextlib.suppress(ValueError):
                seg.busy.remove(entry)

        return release

    @staticmethod
    def hold(future: F, releases: list[Callable[[], None] | None]) -> F:
        """``future``, which calls the ``releases`` of :meth:`claim` once done."""
        mine = [r for r in releases if r is not None]
        if mine:
            future.add_done_callback(lambda _f: [r() for r in mine])
        return future

    # ------------------------------------------------------------ the arenas
    def listen(self, arena: object) -> None:
        """Queue the ids of segments freed from now on for ``arena`` to forget."""
        with self._lock:
            self._freed[id(arena)] = deque()

    def unlisten(self, arena: object) -> None:
        with self._lock:
            self._freed.pop(id(arena), None)

    def freed(self, arena: object) -> list[int]:
        """The ids freed since ``arena`` last asked."""
        with self._lock:
            queue = self._freed.get(id(arena))
            if not queue:
                return []
            out = list(queue)
            queue.clear()
            return out

    def close(self) -> None:
        """Stop lending: later tensors are refused; live ones stay mapped, as memory
        of this process only (their descriptors are closed now)."""
        with self._lock:
            self._closed = True
            segments = list(self._by_base.values())
            self._by_base.clear()
            self._by_id.clear()
            self._freed.clear()
            for seg in segments:
                self._close_fd(seg)

    def _freed_segment(self, seg: SharedSegment) -> None:
        with self._lock:
            if self._by_base.get(seg.base) is seg:
                del self._by_base[seg.base]
            self._by_id.pop(seg.id, None)
            self._close_fd(seg)
            for queue in self._freed.values():
                queue.append(seg.id)

    @staticmethod
    def _close_fd(seg: SharedSegment) -> None:
        if seg.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(seg.fd)
            seg.fd = -1
