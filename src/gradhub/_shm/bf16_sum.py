"""A bf16 sum in C: every vector widened to fp32, added in order, rounded once.

ATen's bf16 addition on one thread takes about twice the time of the same
arithmetic in the C loop below, which the compiler vectorises (1M elements
on this project's 2-core machine: 166 against 83 us; ``benchmarks/backend.py``'s
bf16 rows time the whole all-reduce).
:func:`sum_bf16` forms ``((parts[0] + parts[1]) + ...)`` in fp32 and rounds
to bf16 once, to nearest even, exactly as ATen's bf16 addition does for two
(a NaN is 0xFFFF, as from ATen's vector kernels; its scalar loop, for
the last few elements, gives 0x7FC0).

The C source below is compiled once per machine with the system C compiler
(``$CC``, else ``cc``), on a thread of its own started by the first bf16 sum
(which, as every sum until the library is loaded, ATen forms: a build never
delays a collective), into the user's cache
(``$XDG_CACHE_HOME/gradhub``, else ``~/.cache/gradhub``; where that cannot be
written, ``gradhub-<uid>`` in the temporary folder), under a name that
hashes the source, the flags and this CPU's feature flags (a home folder
shared by machines of different CPUs holds one library per CPU), written to
a temporary name and renamed (ranks that build it at once do not meet
half-written files), and loaded with ctypes. Where it cannot be (no
compiler, a failed build, a platform other than Linux on x86-64 or aarch64,
``GRADHUB_NATIVE=0``), :func:`sum_bf16` says so and the caller adds with
ATen: the same bits.
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
#include <stddef.h>
#include <stdint.h>
#include <string.h>

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
    function = library.gradhub_sum_bf16
    function.restype = None
    function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
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
            return _build_in(folder, f"sum_bf16-{key}.so", compiler)
        except (OSError, subprocess.SubprocessError) as exc:  # read-only, or the build failed
            _log.debug("the C bf16 sum is not in %s (ATen adds instead): %s", folder, exc)
    return None


def _load() -> None:
    global _library
    _library = _build()


def _started() -> threading.Thread:
    """The thread that builds or loads the library, started at the first call."""
    global _loading
    with _start:
        if _loading is None:
            _loading = threading.Thread(target=_load, name="gradhub-bf16-sum", daemon=True)
            _loading.start()
        return _loading


def available() -> bool:
    """Whether the C sum is loaded, once its build or load has ended (waiting for it)."""
    _started().join()
    return _library is not None


def sum_bf16(parts: list[torch.Tensor], out: torch.Tensor) -> bool:
    """``out`` = the fp32 sum of ``parts`` in their order, rounded to bf16 once,
    if ``out`` is bf16 and the C sum is loaded (else nothing is written; a bf16
    sum before the library is loaded starts its build or load on a thread of its
    own); whether it was. ``parts`` and ``out``: contiguous CPU tensors of one
    dtype and length, at least two parts; ``out`` may be one of them."""
    if out.dtype != torch.bfloat16:
        return False
    if _library is None:
        _started()
        return False
    n = out.numel()
    if any(p.numel() != n or not p.is_contiguous() for p in parts) or not out.is_contiguous():
        raise InvalidOptionError("sum_bf16: parts and out must be contiguous and of one length")
    pointers = (ctypes.c_void_p * len(parts))(*(p.data_ptr() for p in parts))
    _library.gradhub_sum_bf16(pointers, len(parts), out.data_ptr(), n)
    return True
