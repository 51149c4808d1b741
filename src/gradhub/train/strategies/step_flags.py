"""What a synchronising backward tells every rank besides the gradients: which
parameters some rank used, and how many samples the ranks processed.

Both are host data from the start (the set of parameters whose hooks ran,
the count given to ``set_samples``), so they are summed as host data: one
small float32 all-reduce on the job's group (shared memory on one host),
launched after the step's last gradient bucket, at the same point on every
rank (a joined rank's shadow step included), and read from host memory. A
step never reads a gradient, flag or count back from a device: no host
synchronisation, as under DDP. Only a group that carries no host tensors
(an NCCL-only group, ``gradhub.init(backend="nccl")``) keeps them on its
device; with two or more ranks there, reading the sums back costs one host
synchronisation a step (DDP with ``find_unused_parameters=True`` reads its
used map back likewise); in a job of one rank the values written are the
sums, read from host memory.

Sums are exact: 0/1 flags and sample counts below 2**24.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from gradhub.collective import CollectiveGroup, all_reduce


class StepFlags:
    """Per-parameter used flags and the sample count, summed over the ranks."""

    def __init__(self, count: int, group: CollectiveGroup) -> None:
        device = group.device
        self.tensor = torch.zeros(count + 2, dtype=torch.float32, device=device)
        """The flags of the ``count`` parameters, the sample count, then whether a
        rank asks for a regroup after this step (a surviving job's replacement
        is ready: every rank then regroups after the same step)."""
        self._host = self.tensor.numpy() if device.type == "cpu" else None
        self._written = np.zeros(count + 2, np.float32) if self._host is None else self._host
        """The values this rank wrote, in host memory (the sums in a job of one rank)."""
        self._group = group
        self._count = count

    def write(self, used: Sequence[bool], samples: float, regroup: bool = False) -> None:
        """This rank's flags and count (host values; nothing is read back)."""
        host = self._written
        host[: self._count] = used  # one conversion of the list in numpy, not one per flag
        host[self._count :] = (samples, regroup)
        if self._host is None:
            self.tensor.copy_(torch.from_numpy(host), non_blocking=True)

    def write_zeros(self) -> None:
        """A joined rank's contribution: nothing used, no sample."""
        self.tensor.zero_()
        if self._host is None:
            self._written[:] = 0

    def launch(self) -> Any:
        """Start summing over the ranks; returns the work to wait for (``None``
        in a job of one rank, whose values are the sum)."""
        if self._group.world_size == 1:
            return None
        return all_reduce(self.tensor, group=self._group)

    def read(self, wait: Callable[[], None] | None = None) -> tuple[np.ndarray, float]:
        """(used anywhere, per parameter; the summed count) after the sum is done."""
        if wait is not None:
            wait()
        values = self._host_values()
        return values[: self._count] > 0, float(values[self._count])

    def regroup(self) -> bool:
        """Whether some rank asked for a regroup after this step (read after the sum;
        on a device-only group a host synchronisation, only in a surviving job)."""
        return bool(self._host_values()[-1] > 0)

    def _host_values(self) -> np.ndarray:
        """The sums in host memory (on a device-only group of two or more ranks,
        read back: one host synchronisation)."""
        if self._host is not None or self._group.world_size == 1:
            return self._written
        return self.tensor.cpu().numpy()
