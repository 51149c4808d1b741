"""Reading another process's memory directly: ``process_vm_readv`` ("cross-memory attach").

One copy from the other process's pages into ours, where going through a
shared segment takes two (the owner's copy in, the reader's copy out). The
kernel allows it only where the reader may trace the owner (same user and,
with Yama's ``ptrace_scope`` at 1, an owner that is its descendant or named
it; containers may forbid it outright), so a user of it asks :func:`readable`
first and keeps a way without it.
"""

from __future__ import annotations

import ctypes
import os

import torch

_libc = ctypes.CDLL(None, use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
if _readv is not None:
    _readv.restype = ctypes.c_ssize_t


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


def read_into(pid: int, address: int, into: torch.Tensor) -> None:
    """Copy ``into.nbytes`` bytes at ``address`` in process ``pid`` into ``into``
    (contiguous, in this process's memory). Raises ``OSError`` (``ESRCH``: the
    process is gone; ``EPERM``: not allowed; ``EFAULT``: not mapped there)."""
    if _readv is None:
        raise OSError(38, "process_vm_readv is not available")  # ENOSYS
    done, total, base = 0, into.numel() * into.element_size(), into.data_ptr()
    while done < total:
        local = _Iovec(base + done, total - done)
        remote = _Iovec(address + done, total - done)
        n = _readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            code = ctypes.get_errno() if n < 0 else 14  # nothing read: EFAULT
            raise OSError(code, f"process_vm_readv from pid {pid}: {os.strerror(code)}")
        done += n


def readable(pid: int, address: int, expected: torch.Tensor) -> bool:
    """Whether this process may read process ``pid``'s memory, checked by reading
    ``expected.numel()`` elements at ``address`` there and comparing them."""
    got = torch.empty_like(expected)
    try:
        read_into(pid, address, got)
    except OSError:
        return False
    return torch.equal(got, expected)
