"""The step's flags and sample count on a group that carries no host tensors
(an NCCL-only group): in a job of one rank they are read from host memory,
never back from the device. A ``meta`` device stands in for the GPU here: any
read of its tensor raises, so a read back shows as an error."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from gradhub.train.strategies.step_flags import StepFlags


def device_only_group(world_size: int) -> Any:
    return SimpleNamespace(device=torch.device("meta"), world_size=world_size)


def test_one_rank_reads_its_own_host_values() -> None:
    flags = StepFlags(3, device_only_group(1))
    flags.write([True, False, True], 8.0, regroup=True)
    assert flags.launch() is None  # a job of one rank: the values are the sums
    used, total = flags.read()
    assert used.tolist() == [True, False, True] and total == 8.0
    assert flags.regroup()
    flags.write_zeros()  # a joined rank's contribution
    used, total = flags.read()
    assert not used.any() and total == 0.0 and not flags.regroup()


def test_two_ranks_read_the_sums_back_from_the_device() -> None:
    flags = StepFlags(2, device_only_group(2))
    flags.write([True, True], 4.0)
    with pytest.raises(NotImplementedError):  # the meta tensor read back
        flags.read()


def test_host_group_reads_the_tensor_itself() -> None:
    group: Any = SimpleNamespace(device=torch.device("cpu"), world_size=2)
    flags = StepFlags(2, group)
    flags.write([False, True], 3.0)
    flags.tensor.add_(torch.tensor([1.0, 1.0, 5.0, 0.0]))  # as the all-reduce sums in place
    used, total = flags.read()
    assert np.array_equal(used, [True, True]) and total == 8.0
