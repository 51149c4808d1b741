"""Futex waits and wakes on a 64-bit counter in a shared segment (Linux only).

A waiter sleeps in the kernel, never spinning: ranks may share fewer cores
than there are ranks, and a spinning waiter would take the core its peer
needs to get to the counter.
"""

from __future__ import annotations

import ctypes
import platform

_SYS_FUTEX = {"x86_64": 202, "aarch64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def futex_supported() -> bool:
    """Whether this machine's futex system call number is known here."""
    return _SYS_FUTEX is not None


def futex_wake(address: int) -> None:
    """Wake every thread sleeping on the counter at ``address``."""
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, 1 << 30)


def futex_wait(address: int, seen: int, seconds: float) -> None:
    """Sleep while the low 32 bits of the counter at ``address`` still read ``seen``,
    at most ``seconds`` (a wake, a change or the timeout ends it)."""
    timeout = _Timespec()
    timeout.tv_sec, timeout.tv_nsec = int(seconds), int((seconds % 1) * 1e9)
    _libc.syscall(
        _SYS_FUTEX,
        ctypes.c_void_p(address),
        _FUTEX_WAIT,
        ctypes.c_uint32(seen & 0xFFFFFFFF),
        ctypes.byref(timeout),
    )
