"""DeepSpeed's CPU shared-memory all-reduce as a benchmark peer.

``deepspeed.comm.inference_all_reduce`` with ``DS_ACCELERATOR=cpu``: a C++ op
(``deepspeed_shm_comm``, compiled with ninja at first use, about a minute,
cached under ``~/.cache/torch_extensions``) that sums fp32, bf16 and fp16 in
POSIX shared memory among the ranks of one host (``LOCAL_SIZE`` of them),
waiting on its flags by spinning. It is used on the gloo group; the op itself
is set up for the default group's world (its rank and size), and only when
that world is all local. DeepSpeed silently falls back to
``torch.distributed.all_reduce`` where the op is missing or the CPU lacks the
instructions its kernels need (AVX2 for fp32, AVX-512BW for 16 bits):
:func:`setup` refuses those cases, so a row named DeepSpeed always ran its op.

DeepSpeed is an optional peer (the ``bench`` extra); :func:`setup` returns
``None`` and the reason when it cannot run here.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

AllReduce = Callable[[torch.Tensor], None]


def environment(local_size: int, port: int) -> None:
    """The variables DeepSpeed reads: set before it is imported. The port (the
    job's own) names its shared-memory files, so concurrent runs do not meet."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["LOCAL_SIZE"] = str(local_size)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))


def setup(group: Any, dtypes: list[torch.dtype]) -> tuple[AllReduce | None, str]:
    """DeepSpeed's shared-memory all-reduce on ``group`` (called on every rank,
    after :func:`environment` and ``init_process_group``), or ``None`` and why not."""
    try:
        import deepspeed.comm as ds_comm
    except Exception as exc:  # not installed, or its import fails on this machine
        return None, f"deepspeed cannot be imported: {type(exc).__name__}: {exc}"
    try:
        ds_comm.init_distributed(dist_backend="gloo", verbose=False)
    except Exception as exc:  # the shm op did not build or load
        return None, f"deepspeed's shm op is unavailable: {type(exc).__name__}: {exc}"
    backend = ds_comm.comm.cdb
    if getattr(backend, "shm_comm_op", None) is None:
        return None, "deepspeed built no shm op (ShareMemCommBuilder incompatible here)"
    level = getattr(backend, "shm_vector_kernel_level", 0)
    need = 2 if any(d != torch.float32 for d in dtypes) else 1
    if level < need:
        return None, f"this CPU's vector level is {level}; deepspeed's shm kernels need {need}"

    def all_reduce(t: torch.Tensor) -> None:
        ds_comm.inference_all_reduce(t, group=group)

    return all_reduce, ""


def version() -> dict[str, str]:
    """The installed DeepSpeed's version, recorded beside its rows (not imported here)."""
    return {"version": importlib.metadata.version("deepspeed")}


def remove_files(rank: int) -> None:
    """Unlink this rank's shared-memory file (the op never does): 66 MB of
    ``/dev/shm`` each. Call after every rank is done with the op."""
    port, addr = os.environ.get("MASTER_PORT", ""), os.environ.get("MASTER_ADDR", "")
    uid = os.getuid()
    name = f"deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"
    Path("/dev/shm", name).unlink(missing_ok=True)
