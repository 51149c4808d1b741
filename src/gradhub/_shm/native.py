"""The shared-memory transport's C part: a bf16 sum, and two ranks' all-reduce.

- :func:`sum_bf16`: every vector widened to fp32, added in order, rounded
  once. ATen's bf16 addition on one thread takes about twice the time of the
  same arithmetic in the C loop below, which the compiler vectorises (1M
  elements on this project's 2-core machine: 166 against 83 us). It forms
  ``((parts[0] + parts[1]) + ...)`` in fp32 and rounds to bf16 once, to
  nearest even, exactly as ATen's bf16 addition does for two (a NaN is
  0xFFFF, as from ATen's vector kernels; its scalar loop, for the last few
  elements, gives 0x7FC0).
- :func:`all_reduce_pair`: one rank's side of the two-rank all-reduce of one
  synchronisation (:mod:`gradhub.transports.shm`): copy into its region,
  publish its counter and wake the peer, poll the peer's counter for a
  bounded time, add the two regions. The same steps as the transport's
  Python ones, the same bits (fp32: ``first + second``, an exact IEEE
  addition either way; bf16: :func:`sum_bf16`'s), in one call instead of a
  dozen: a small all-reduce's time is mostly those calls (16 fp32 elements:
  about 4 us in Python, against DeepSpeed's whole all-reduce of 3 us).
- :func:`all_reduce_halves`: two ranks' all-reduce of larger vectors in two
  synchronisations, each rank adding one half (the transport's
  reduce-scatter and all-gather through the regions, the same bits), in at
  most three calls where the polls run out, instead of two operations' worth
  of Python.

The C source below is compiled once per machine with the system C compiler
(``$CC``, else ``cc``), on a thread of its own started by the first call
(which, as every call until the library is loaded, Python and ATen serve
instead: a build never delays a collective), into the user's cache
(``$XDG_CACHE_HOME/gradhub``, else ``~/.cache/gradhub``; where that cannot be
written, ``gradhub-<uid>`` in the temporary folder), under a name that
hashes the source, the flags and this CPU's feature flags (a home folder
shared by machines of different CPUs holds one library per CPU), written to
a temporary name and renamed (ranks that build it at once do not meet
half-written files), and loaded with ctypes. Where it cannot be (no
compiler, a failed build, a platform other than Linux on x86-64 or aarch64,
``GRADHUB_NATIVE=0``), each function says so and the caller does the same
work in Python and ATen: the same bits.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from gradhub.errors import InvalidOptionError

_log = logging.getLogger("gradhub.collective")

SOURCE = r"""
#define _GNU_SOURCE
#include <linux/futex.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static inline float widen(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t round_even(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return f != f ? (uint16_t)0xFFFF : (uint16_t)r; /* a NaN: ATen's vector kernels give 0xFFFF */
}

/* out = ((parts[0] + parts[1]) + ...) + parts[k - 1] in fp32, rounded once;
   out may be one of the parts (each block is read whole before it is written). */
void gradhub_sum_bf16(const uint16_t *const *parts, int k, uint16_t *out, size_t n) {
  float acc[1024];
  for (size_t start = 0; start < n; start += 1024) {
    size_t m = n - start < 1024 ? n - start : 1024;
    const uint16_t *first = parts[0] + start;
    for (size_t i = 0; i < m; i++) acc[i] = widen(first[i]);
    for (int j = 1; j < k; j++) {
      const uint16_t *p = parts[j] + start;
      for (size_t i = 0; i < m; i++) acc[i] += widen(p[i]);
    }
    for (size_t i = 0; i < m; i++) out[start + i] = round_even(acc[i]);
  }
}

/* out = first + second: fp32 (dtype 0), or bf16 widened, added, rounded once (1).
   The fence orders these reads after the caller's read of the peer's counter. */
void gradhub_sum_pair(void *out, const void *first, const void *second, size_t n, int dtype) {
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  if (dtype == 1) {
    const uint16_t *parts[2] = {first, second};
    gradhub_sum_bf16(parts, 2, out, n);
    return;
  }
  const float *a = first, *b = second;
  float *o = out;
  for (size_t i = 0; i < n; i++) o[i] = a[i] + b[i];
}

static inline void relax(void) {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

static int64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void publish(int64_t *entered, int64_t k) {
  __atomic_store_n(entered, k, __ATOMIC_RELEASE);
  syscall(SYS_futex, entered, FUTEX_WAKE, 1 << 30, NULL, NULL, 0);
}

/* Whether the peer's counter reached k within spin_ns of polling. */
static int reached(const int64_t *theirs, int64_t k, int64_t spin_ns) {
  if (__atomic_load_n(theirs, __ATOMIC_ACQUIRE) >= k) return 1;
  if (spin_ns <= 0) return 0;
  int64_t end = now_ns() + spin_ns;
  unsigned polls = 0;
  while (__atomic_load_n(theirs, __ATOMIC_ACQUIRE) < k) {
    relax();
    if ((++polls & 63) == 0 && now_ns() > end) return 0;
  }
  return 1;
}

/* One rank's side of two ranks' all-reduce of one synchronisation: copy n
   elements (dtype as above) of data into mine (this rank's region), store k in
   entered (this rank's counter, after the copy) and wake its waiters, poll
   theirs (the peer's counter) for at most spin_ns. Returns 0 where the peer's
   counter is still below k (nothing added: the caller waits, then adds);
   else data = first + second (the two regions, by rank) and 1. */
int gradhub_all_reduce_pair(void *data, void *mine, const void *first, const void *second,
                            size_t n, int dtype, int64_t *entered, const int64_t *theirs,
                            int64_t k, int64_t spin_ns) {
  memcpy(mine, data, n * (dtype == 1 ? 2 : 4));
  publish(entered, k);
  if (!reached(theirs, k, spin_ns)) return 0;
  gradhub_sum_pair(data, first, second, n, dtype);
  return 1;
}

/* One rank's side of two ranks' all-reduce in halves, operations k and k + 1:
   rank 0 sums the first ceil(n / 2) elements, rank 1 the rest. Stage 0: copy
   the peer's half of data into a_mine (this rank's region of operation k),
   publish k. Stage 1 (the peer's counter at k): add the peer's copy of this
   rank's half to it in data, copy that sum into b_mine (operation k + 1),
   publish k + 1. Stage 2 (the peer's counter at k + 1): copy the peer's sum
   out of b_theirs. Runs from stage `stage` on; returns the stage whose wait
   the poll (spin_ns each) did not end (the caller waits, then calls again from
   there), or 3: done. Each element is one addition of the two ranks' values,
   as in gradhub_sum_pair: the same bits. */
int gradhub_all_reduce_halves(char *data, char *a_mine, const char *a_theirs, char *b_mine,
                              const char *b_theirs, size_t n, int index, int dtype,
                              int64_t *entered, const int64_t *theirs, int64_t k,
                              int64_t spin_ns, int stage) {
  size_t size = dtype == 1 ? 2 : 4, half = (n + 1) / 2;
  size_t mine_at = index == 0 ? 0 : half, mine_n = index == 0 ? half : n - half;
  size_t peer_at = index == 0 ? half : 0, peer_n = n - mine_n;
  /* Resumed after the caller's wait: an acquire load of the counter it saw. */
  if (stage > 0 && !reached(theirs, k + stage - 1, 0)) return stage;
  if (stage == 0) {
    memcpy(a_mine + peer_at * size, data + peer_at * size, peer_n * size);
    publish(entered, k);
    if (!reached(theirs, k, spin_ns)) return 1;
    stage = 1;
  }
  if (stage == 1) {
    char *own = data + mine_at * size;
    gradhub_sum_pair(own, own, a_theirs + mine_at * size, mine_n, dtype);
    memcpy(b_mine + mine_at * size, own, mine_n * size);
    publish(entered, k + 1);
    if (!reached(theirs, k + 1, spin_ns)) return 2;
  }
  memcpy(data + peer_at * size, b_theirs + peer_at * size, peer_n * size);
  return 3;
}
"""
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-fno-fast-math"]
_BUILD_SECONDS = 120

_library: ctypes.CDLL | None = None
_loading: threading.Thread | None = None
_start = threading.Lock()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("flags", "Features"):
                return line
    except OSError:
        pass
    return platform.processor()


def _caches() -> list[Path]:
    """Where the library may be kept: the user's cache, else the temporary folder."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return [Path(root) / "gradhub", Path(tempfile.gettempdir()) / f"gradhub-{os.getuid()}"]


def _build_in(folder: Path, name: str, compiler: str | None) -> ctypes.CDLL | None:
    """The library ``folder/name``, built there first if it is not yet."""
    target = folder / name
    if not target.exists():
        if compiler is None:
            return None
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            source, built = Path(scratch, "sum.c"), Path(scratch, "sum.so")
            source.write_text(SOURCE)
            subprocess.run(
                [compiler, *FLAGS, "-o", str(built), str(source)],
                check=True,
                capture_output=True,
                timeout=_BUILD_SECONDS,
            )
            os.replace(built, target)
    library = ctypes.CDLL(str(target))
    pointer, size, int64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
    library.gradhub_sum_bf16.restype = None
    library.gradhub_sum_bf16.argtypes = [pointer, ctypes.c_int, pointer, size]
    library.gradhub_sum_pair.restype = None
    library.gradhub_sum_pair.argtypes = [pointer, pointer, pointer, size, ctypes.c_int]
    library.gradhub_all_reduce_pair.restype = ctypes.c_int
    library.gradhub_all_reduce_pair.argtypes = [
        *(pointer, pointer, pointer, pointer, size, ctypes.c_int),
        *(pointer, pointer, int64, int64),
    ]
    library.gradhub_all_reduce_halves.restype = ctypes.c_int
    library.gradhub_all_reduce_halves.argtypes = [
        *(pointer, pointer, pointer, pointer, pointer, size, ctypes.c_int, ctypes.c_int),
        *(pointer, pointer, int64, int64, ctypes.c_int),
    ]
    return library


def _build() -> ctypes.CDLL | None:
    """The compiled library, built here if not cached; ``None`` where it cannot be."""
    if os.environ.get("GRADHUB_NATIVE") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, _cpu_flags()]).encode()).hexdigest()[:16]
    for folder in _caches():
        try:
            return _build_in(folder, f"native-{key}.so", compiler)
        except (OSError, subprocess.SubprocessError) as exc:  # read-only, or the build failed
            _log.debug("the C part is not in %s (Python and ATen do its work): %s", folder, exc)
    return None


def _load() -> None:
    global _library
    _library = _build()


def _started() -> threading.Thread:
    """The thread that builds or loads the library, started at the first call."""
    global _loading
    with _start:
        if _loading is None:
            _loading = threading.Thread(target=_load, name="gradhub-native", daemon=True)
            _loading.start()
        return _loading


def available() -> bool:
    """Whether the library is loaded, once its build or load has ended (waiting for it)."""
    _started().join()
    return _library is not None


PAIR_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
"""The dtypes :func:`all_reduce_pair` adds, by their code in the C source."""


def loaded() -> bool:
    """Whether the library is loaded (without waiting; the first call starts its
    build or load on a thread of its own)."""
    if _library is None:
        _started()
        return False
    return True


def sum_bf16(parts: list[torch.Tensor], out: torch.Tensor) -> bool:
    """``out`` = the fp32 sum of ``parts`` in their order, rounded to bf16 once,
    if ``out`` is bf16 and the C sum is loaded (else nothing is written; a bf16
    sum before the library is loaded starts its build or load on a thread of its
    own); whether it was. ``parts`` and ``out``: contiguous CPU tensors of one
    dtype and length, at least two parts; ``out`` may be one of them."""
    if out.dtype != torch.bfloat16 or not loaded():
        return False
    assert _library is not None
    n = out.numel()
    if any(p.numel() != n or not p.is_contiguous() for p in parts) or not out.is_contiguous():
        raise InvalidOptionError("sum_bf16: parts and out must be contiguous and of one length")
    pointers = (ctypes.c_void_p * len(parts))(*(p.data_ptr() for p in parts))
    _library.gradhub_sum_bf16(pointers, len(parts), out.data_ptr(), n)
    return True


def all_reduce_pair(
    data: torch.Tensor,
    regions: list[torch.Tensor],
    index: int,
    entered: int,
    theirs: int,
    k: int,
    spin: float,
) -> bool:
    """Rank ``index``'s side of two ranks' one-synchronisation all-reduce of
    ``data`` (contiguous, fp32 or bf16) through ``regions`` (one per rank, each
    ``data``'s length and dtype), the library :func:`loaded`: with ``data``
    copied into this rank's region and ``k`` stored at address ``entered`` (this
    rank's counter, its waiters woken), whether the counter at ``theirs`` (the
    peer's) reached ``k`` within ``spin`` seconds of polling, and then ``data``
    holds the sum. ``False``: the caller waits for the peer, then calls
    :func:`sum_pair`."""
    assert _library is not None
    return bool(
        _library.gradhub_all_reduce_pair(
            data.data_ptr(),
            regions[index].data_ptr(),
            regions[0].data_ptr(),
            regions[1].data_ptr(),
            data.numel(),
            PAIR_DTYPES[data.dtype],
            entered,
            theirs,
            k,
            int(spin * 1e9),
        )
    )


def all_reduce_halves(
    data: torch.Tensor,
    first: list[torch.Tensor],
    second: list[torch.Tensor],
    index: int,
    entered: int,
    theirs: int,
    k: int,
    spin: float,
    stage: int,
) -> int:
    """Rank ``index``'s side of two ranks' all-reduce of ``data`` (contiguous,
    fp32 or bf16) in halves, operations ``k`` (through the regions ``first``)
    and ``k + 1`` (``second``), the library :func:`loaded`, from ``stage`` (0:
    the start) on: the stage whose wait for the peer's counter (at ``entered``,
    ``theirs`` as in :func:`all_reduce_pair`) did not end within ``spin``
    seconds of polling, 1 (``k``) or 2 (``k + 1``), for the caller to wait and
    call again from there; 3: ``data`` holds the sum."""
    assert _library is not None
    code: int = _library.gradhub_all_reduce_halves(
        *(data.data_ptr(), first[index].data_ptr(), first[1 - index].data_ptr()),
        *(second[index].data_ptr(), second[1 - index].data_ptr()),
        *(data.numel(), index, PAIR_DTYPES[data.dtype], entered, theirs, k),
        *(int(spin * 1e9), stage),
    )
    return code


def sum_pair(regions: list[torch.Tensor], out: torch.Tensor) -> None:
    """``out`` = ``regions[0] + regions[1]`` as :func:`all_reduce_pair` adds them
    (the library :func:`loaded`)."""
    assert _library is not None
    first, second = regions
    _library.gradhub_sum_pair(
        out.data_ptr(), first.data_ptr(), second.data_ptr(), out.numel(), PAIR_DTYPES[out.dtype]
    )
