"""A 2-rank job (``gradhub run -n 2``) that reports whether closing its runtime
let go of the process group; writes ``rank<r>.json`` into the folder given."""

from __future__ import annotations

import gc
import importlib
import json
import sys
import weakref
from pathlib import Path

import torch

import gradhub


def main() -> None:
    runtime = gradhub.init(timeout=60)
    group = weakref.ref(runtime.group.process_group)
    # torch imports its compiler (and with it torch.distributed.nn.functional)
    # lazily, e.g. at an optimizer's first step: after the group exists.
    importlib.import_module("torch._dynamo")

    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = gradhub.prepare(model, optimizer, strategy="allreduce", runtime=runtime)
    for _ in range(3):
        model(torch.randn(4, 8)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    total = runtime.all_reduce_sum(torch.tensor([1.0]), where="the job's last sum")
    rank = runtime.rank
    runtime.close()
    gc.collect()
    result = {"total": float(total), "alive": group() is not None}
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
