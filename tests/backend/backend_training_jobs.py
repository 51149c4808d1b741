"""Rank functions training through the gradhub backend: DDP, FSDP2, a kill,
Lightning and Accelerate (module-level, importable by the harness)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
from backend_jobs import init
from torch.nn.parallel import DistributedDataParallel as DDP

from gradhub.demo.job import make_mlp
from gradhub.demo.threads import load_digits_split

STEPS = 6
BATCH = 32  # per rank


def _batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y, _, _ = load_digits_split(0.2, seed=0)
    start = (step * world_size + rank) * BATCH
    return x[start : start + BATCH], y[start : start + BATCH]


def _train_ddp(model: torch.nn.Module, group: Any, rank: int, world_size: int) -> torch.nn.Module:
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.01)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        x, y = _batch(step, rank, world_size)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return model


def ddp_and_fsdp(rank: int, world_size: int) -> dict[str, Any]:
    """DDP on gradhub ends with gloo's bits; FSDP2 on gradhub equals one process."""
    init(rank, world_size)
    gloo = dist.new_group(backend="gloo")
    on_gradhub = _train_ddp(make_mlp(1), None, rank, world_size)
    on_gloo = _train_ddp(make_mlp(1), gloo, rank, world_size)
    ddp_equal = all(
        torch.equal(a, b)
        for a, b in zip(on_gradhub.parameters(), on_gloo.parameters(), strict=True)
    )

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = make_mlp(2)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = _batch(step, rank, world_size)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    sharded = {k: v.full_tensor() for k, v in model.state_dict().items()}

    reference = make_mlp(2)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        parts = [_batch(step, r, world_size) for r in range(world_size)]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x), y).backward()
        ref_opt.step()
    fsdp_error = max((sharded[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    backend = dist.get_backend(mesh.get_group())
    dist.destroy_process_group()
    return {"ddp_equal": ddp_equal, "fsdp_error": fsdp_error, "mesh_backend": backend}


def killed_during_ddp(rank: int, world_size: int, timeout: float) -> dict[str, Any]:
    """The last rank SIGKILLs itself in step 3; the others must fail naming it."""
    init(rank, world_size, timeout=timeout)
    ddp = DDP(make_mlp(1))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    begin = 0.0
    try:
        for step in range(STEPS):
            x, y = _batch(step, rank, world_size)
            if step == 3 and rank == world_size - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x), y)
            begin = time.monotonic()
            loss.backward()
            opt.step()
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - begin}
    return {"error": None}


class _Digits(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_mlp(3)


def lightning_job(rank: int, world_size: int) -> dict[str, Any]:
    """A Lightning Trainer with DDPStrategy(process_group_backend="gradhub")."""
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_mlp(3)

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    x, y, _, _ = load_digits_split(0.2, seed=0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=DDPStrategy(process_group_backend="gradhub"),
        max_epochs=1,
        limit_train_batches=8,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
    )
    trainer.fit(module, data)
    backend = dist.get_backend()
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    changed = not torch.equal(flat, torch.cat([p.reshape(-1) for p in make_mlp(3).parameters()]))
    return {"backend": backend, "same": same, "changed": changed, "steps": trainer.global_step}


def accelerate_job(rank: int, world_size: int) -> dict[str, Any]:
    """Accelerate with the gradhub group initialised first."""
    init(rank, world_size)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = make_mlp(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y, _, _ = load_digits_split(0.2, seed=0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    model, opt, data = accelerator.prepare(model, opt, data)
    for i, (xb, yb) in enumerate(data):
        if i == 5:
            break
        opt.zero_grad()
        accelerator.backward(torch.nn.functional.cross_entropy(model(xb), yb))
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    wrapped = isinstance(model, DDP)
    backend = dist.get_backend(model.process_group) if wrapped else None
    dist.destroy_process_group()
    return {
        "same": all(torch.equal(g, gathered[0]) for g in gathered),
        "ddp": wrapped,
        "backend": backend,
        "processes": accelerator.num_processes,
    }
