"""Ray Train's TorchTrainer on the "gradhub" torch.distributed backend.

    python examples/ray_train.py                          # a local Ray cluster, 2 workers
    python examples/ray_train.py --address auto --workers 4   # a running cluster

The one gradhub line is ``TorchConfig(backend="gradhub")``; the training loop
does not import gradhub: Ray's workers import torch, and gradhub's
``torch.backends`` entry point registers the backend there. The model is a
linear regression on generated data, ``y = x @ w + noise`` with noise of
standard deviation 0.1, so a trained model's mean squared error is the
noise's variance, 0.01. Every worker ends with the same parameters, bit for
bit; rank 0 saves them as the run's checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import tempfile
from pathlib import Path
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.train import Checkpoint, RunConfig, ScalingConfig, get_context, report
from ray.train.torch import TorchConfig, TorchTrainer, prepare_data_loader, prepare_model
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

NOISE = 0.1


def make_data(n: int, features: int = 8) -> TensorDataset:
    """``y = x @ w + NOISE * randn`` (generated, nothing to download)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    return TensorDataset(x, x @ w + NOISE * torch.randn(n, 1, generator=g))


def digest(model: torch.nn.Module) -> str:
    """SHA-256 of the parameters' bytes: equal digests, equal bits."""
    data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    return hashlib.sha256(data).hexdigest()


def train_loop(config: dict[str, Any]) -> None:
    """What every worker runs, in the process group Ray Train made."""
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(8, 1))  # DDP over the "gradhub" group
    data = DataLoader(make_data(config["samples"]), batch_size=16, shuffle=True)
    loader = prepare_data_loader(data)  # each worker its share (DistributedSampler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(config["epochs"]):
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        total = torch.zeros(2)  # the epoch's loss sum and batch count
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += torch.stack([loss.detach(), torch.tensor(1.0)])
    dist.all_reduce(total)  # over every worker
    replicas: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(replicas, digest(model.module))
    metrics = {"loss": (total[0] / total[1]).item(), "backend": dist.get_backend()}
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = None
        if get_context().get_world_rank() == 0:
            torch.save(model.module.state_dict(), Path(folder) / "model.pt")
            checkpoint = Checkpoint.from_directory(folder)
        report({**metrics, "replicas": replicas}, checkpoint=checkpoint)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--address", help="a running Ray cluster (default: start a local one)")
    p.add_argument("--storage-path", help="where Ray Train keeps the run (default ~/ray_results)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    if args.address:
        ray.init(address=args.address)
    else:  # a CPU per worker, no dashboard, the smallest object store Ray takes
        ray.init(num_cpus=args.workers, include_dashboard=False, object_store_memory=75 * 2**20)
    try:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"epochs": args.epochs, "samples": args.samples},
            scaling_config=ScalingConfig(num_workers=args.workers),
            torch_config=TorchConfig(backend="gradhub"),  # instead of "gloo"
            run_config=RunConfig(storage_path=args.storage_path),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()

    model = torch.nn.Linear(8, 1)
    with result.checkpoint.as_directory() as folder:
        model.load_state_dict(torch.load(Path(folder) / "model.pt", weights_only=True))
    out = {**result.metrics, "checkpoint": digest(model)}
    logging.info(
        "%d workers on %r: loss %.4f (noise floor %.4f); replicas identical: %s",
        args.workers,
        out["backend"],
        out["loss"],
        NOISE**2,
        len({*out["replicas"], out["checkpoint"]}) == 1,
    )
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
