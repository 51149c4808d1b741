import sys
from pathlib import Path

import pytest
import torch

# Tests live in one folder per package (collective/, ps/, train/, core/, jobs/);
# the shared helpers (harness.py, cluster.py, train/train_helpers.py, the *_jobs.py
# modules) are imported by bare name, also by the ranks the harness forks, whose
# server takes sys.path as it is when the first job starts: put every folder on it now.
_HERE = Path(__file__).resolve().parent
for _folder in [_HERE, *sorted(p for p in _HERE.iterdir() if p.is_dir() and p.name[0] not in "._")]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
