"""torch's own distributed test suite (``DistributedTest._DistTestBase``, shipped in
the wheel) run the way torch's ``test/distributed/test_distributed_spawn.py`` runs
it, for ``BACKEND=gloo`` or ``BACKEND=gradhub``.

Run it with pytest and the environment set (``make test-torch-dist`` runs the
full list for both backends; ``test_torch_dist_selection.py`` runs a selection
inside the normal suite)::

    BACKEND=gradhub WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) \\
        python -m pytest -p no:warnings tests/backend/torch_dist_suite.py

The module is not named ``test_*``, so the normal suite does not collect it.
gradhub is added to torch's feature table for "ddp" and "subgroup" (what it
supports on CPU). Cases torch itself gates on the name ``"gloo"`` (``BACKEND != "gloo"``: skipped
with torch's own reason, e.g. "Only gloo backend supports timeouts") are
reported as skipped by torch; :data:`EXCLUDED` lists the further cases skipped
for ``gradhub``, each with its reason.
"""

from __future__ import annotations

import os
import sys
import unittest

import torch
import torch.distributed as dist

import gradhub  # noqa: F401  (registers "gradhub" in this process and the spawned ranks)

if not os.environ.get("TEMP_DIR") or not os.environ.get("BACKEND"):
    raise RuntimeError(
        "set BACKEND (gloo or gradhub), WORLD_SIZE and TEMP_DIR (a directory) to run "
        "torch's distributed suite"
    )
os.makedirs(os.path.join(os.environ["TEMP_DIR"], "barrier"), exist_ok=True)
os.environ.setdefault("WORLD_SIZE", "2")

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

# torch's feature table (read when distributed_test is imported) gates cases on
# backend names; gradhub has what these name on CPU: DDP and sub-groups. It has
# no GPU support, so "gpu" and "cuda" stay gloo's, nccl's and ucc's.
if os.environ["BACKEND"] == "gradhub":
    for _feature in ("ddp", "subgroup"):
        DistTestCases.backend_feature[_feature].add("gradhub")

from torch.testing._internal.distributed.distributed_test import (  # noqa: E402
    DistributedTest,
    TestDistBackend,
)

BACKEND = os.environ["BACKEND"]

EXCLUDED: dict[str, str] = {}
"""Cases of ``_DistTestBase`` skipped on ``gradhub`` (name -> reason)."""


class _Spawned(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()


_Spawned.__name__ = _Spawned.__qualname__ = f"TestDistBackendWithSpawn{BACKEND.upper()}"
if BACKEND == "gradhub":
    for _name, _reason in EXCLUDED.items():
        if hasattr(_Spawned, _name):
            setattr(_Spawned, _name, unittest.skip(_reason)(getattr(_Spawned, _name)))
globals()[_Spawned.__name__] = _Spawned
del _Spawned

torch.backends.cuda.matmul.allow_tf32 = False
assert dist.is_available()

if __name__ == "__main__":
    from torch.testing._internal.common_utils import run_tests

    sys.exit(run_tests())
