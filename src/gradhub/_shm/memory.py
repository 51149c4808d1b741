"""Shared segments: anonymous ``memfd`` files, their mappings, set-up I/O.

Linux only. A segment is an anonymous ``memfd`` (nothing named, so nothing is
left behind when a process is killed), mapped shared and viewed as bytes.
Waiting on a counter in a segment is :mod:`.futex`'s.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import socket
import traceback
from collections.abc import Callable
from typing import ParamSpec

import torch

from gradhub._shm.futex import futex_supported

_log = logging.getLogger("gradhub.collective")


def supported() -> bool:
    """Whether this platform has what the transport needs."""
    return (
        futex_supported()
        and hasattr(os, "memfd_create")
        and hasattr(os, "pidfd_open")
        and hasattr(socket, "send_fds")
    )


class Mapping:
    """One mapped memfd; the descriptor is closed as soon as it is mapped."""

    def __init__(self, fd: int, size: int):
        try:
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.size = size
        # Through a memoryview: it holds the mapping exported while any tensor views it
        # (torch.frombuffer of the mmap itself does not), so close() cannot unmap
        # memory a tensor still reads; the last view lets the GC unmap it.
        self.bytes = torch.frombuffer(memoryview(self.mm), dtype=torch.uint8) if size else None

    def close(self) -> None:
        self.bytes = None
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere; the GC unmaps it
            _log.debug("shared-memory mapping still in use; left to the garbage collector")


def new_segment(size: int, name: str) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


_P = ParamSpec("_P")


def forgetting_views(fn: Callable[_P, None]) -> Callable[_P, None]:
    """On an error, clear the locals of the frames it passed through: their views
    of the segments would keep the mappings (and their descriptors) alive for as
    long as anyone holds the exception."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> None:
        try:
            fn(*args, **kwargs)
        except BaseException as exc:
            traceback.clear_frames(exc.__traceback__)
            raise

    return wrapper


def recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed the connection during set-up")
        data += chunk
    return data
