"""A torchrun + DDP training script, ported to gradhub: the own-loop path.

    gradhub run -n 2 examples/ddp_port.py                       # allreduce
    gradhub run -n 2 examples/ddp_port.py --device cpu          # CPU also where CUDA is
    gradhub run -n 2 examples/ddp_port.py --strategy sharded
    gradhub run -n 2 --servers 1 --ps-mode sync examples/ddp_port.py --strategy ps-sync
    torchrun --nproc-per-node 2 examples/ddp_port.py

Everything a DDP script does stays as it was: a DataLoader with a
DistributedSampler, the loop with zero_grad / backward / clip / step,
StepLR, 2-step gradient accumulation with ``no_sync()``, a checkpoint
written by rank 0. The lines that changed are marked ``# gradhub``; the DDP
original of each is in the comment above it. The model goes to ``--device``
(default: this rank's GPU where CUDA is, else the CPU), batches to the model.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import gradhub


def make_data(n: int = 512) -> TensorDataset:
    """Three Gaussian blobs in 16 dimensions (generated, nothing to download)."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 16, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return TensorDataset(centres[y] + 1.5 * torch.randn(n, 16, generator=g), y)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strategy", default="allreduce", help="allreduce, sharded, ps-async, ...")
    p.add_argument("--servers", nargs="*", help="parameter-server addresses (ps-* strategies)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--checkpoint", default=None, help="rank 0 writes model+optimizer here")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    # runtime = torch.distributed.init_process_group("gloo")
    runtime = gradhub.init()  # gradhub
    rank, world = runtime.rank, runtime.world_size
    device = runtime.local_device(args.device)  # cuda: the GPU LOCAL_RANK picks

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 3))
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # model = DistributedDataParallel(model)
    options = {"servers": args.servers} if args.servers else {}
    model, optimizer = gradhub.prepare(
        model, optimizer, strategy=args.strategy, **options
    )  # gradhub
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)

    dataset = make_data(args.samples)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler)
    losses: list[float] = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)
            last_micro = i % 2 == 1  # 2-step accumulation: communicate on the second
            with contextlib.nullcontext() if last_micro else model.no_sync():
                loss = F.cross_entropy(model(x), y) / 2
                loss.backward()
            losses.append(loss.item() * 2)
            if last_micro:
                # torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                gradhub.clip_grad_norm_(model, 1.0)  # gradhub
                optimizer.step()
                optimizer.zero_grad()
                scheduler.step()
        if rank == 0:
            logging.info("epoch %d: mean loss %.4f", epoch, sum(losses[-16:]) / 16)
    # model.module.state_dict() under DDP; the optimizer's state dict is the full one
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if rank == 0 and args.checkpoint:
        Path(args.checkpoint).parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, args.checkpoint)
    model.close()
    runtime.close()
    k = max(1, len(losses) // 4)
    return {"first": sum(losses[:k]) / k, "last": sum(losses[-k:]) / k}


if __name__ == "__main__":
    main()
