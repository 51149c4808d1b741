import sys
from pathlib import Path

import pytest
import torch

# Tests live in one folder per package (collective/, ps/ with client/, server/ and
# wire/, train/, core/, jobs/);
# the shared helpers (harness.py, cluster.py, train/train_helpers.py, the *_jobs.py
# modules) are imported by bare name, also by the ranks the harness forks, whose
# server takes sys.path as it is when the first job starts: put every folder on it now.
_HERE = Path(__file__).resolve().parent
_FOLDERS = [
    p
    for p in _HERE.rglob("*")
    if p.is_dir() and not any(part[0] in "._" for part in p.relative_to(_HERE).parts)
]
for _folder in [_HERE, *sorted(_FOLDERS)]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
