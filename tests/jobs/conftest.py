"""Fixtures the job tests share: the survival tests' single-process references
(one per test process: each is a training run of its own)."""

from __future__ import annotations

import pytest
import torch

from survive_checks import reference


@pytest.fixture(scope="session")
def sgd(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """``survive_job.py`` on one process, momentum SGD: its final parameters."""
    return reference(tmp_path_factory.mktemp("reference-sgd"))


@pytest.fixture(scope="session")
def adamw(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """The same with AdamW."""
    return reference(tmp_path_factory.mktemp("reference-adamw"), "--optimizer", "adamw")
