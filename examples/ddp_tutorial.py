"""pytorch/examples' DDP tutorial (``multigpu_torchrun.py``), ported to gradhub by
changing the init and wrap lines only; on this rank's GPU where CUDA is
(the tutorial's ``gpu_id``), else on the CPU (``--device``).

The tutorial's structure: a ``Trainer`` class, a ``DistributedSampler`` with
``set_epoch`` every epoch, a snapshot (model state and epochs run) saved by
rank 0 every ``save_every`` epochs and loaded before the wrap when it
exists, so a second launch resumes. The data is a learnable classification
task generated here instead of random targets, and every epoch ends with a
validation loss (what the tests compare).

    gradhub run -n 2 examples/ddp_tutorial.py 4 1 --strategy sharded
    gradhub run -n 2 --servers 1 --ps-mode sync examples/ddp_tutorial.py 4 1 --strategy ps-sync
    torchrun --nproc-per-node 2 examples/ddp_tutorial.py 4 1 --ddp    # the DDP original

The two lines that differ from the DDP script are marked ``# gradhub``;
``--ddp`` runs the original lines instead.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gradhub

ARGS: argparse.Namespace


def ddp_setup() -> None:
    if ARGS.ddp:
        init_process_group(backend="nccl" if ARGS.device == "cuda" else "gloo")
    else:
        gradhub.init()  # gradhub


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
    ) -> None:
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.device = torch.device(ARGS.device)
        if ARGS.device == "cuda":  # the tutorial: one GPU per rank, gpu_id
            self.device = torch.device("cuda", self.gpu_id % torch.cuda.device_count())
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        self.val_losses: dict[int, float] = {}
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.start_epoch = self.epochs_run

        if ARGS.ddp:
            self.model = DDP(self.model)
        else:
            servers = {"servers": ARGS.servers} if ARGS.servers else {}
            self.model, self.optimizer = gradhub.prepare(  # gradhub
                self.model, self.optimizer, strategy=ARGS.strategy, **servers
            )

    def _load_snapshot(self, snapshot_path: str) -> None:
        snapshot = torch.load(snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source: torch.Tensor, targets: torch.Tensor) -> None:
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch: int) -> None:
        b_sz = len(next(iter(self.train_data))[0])
        print(
            f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}"
        )
        self.train_data.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        for source, targets in self.train_data:
            self._run_batch(source.to(self.device), targets.to(self.device))

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    @torch.no_grad()
    def _validate(self, epoch: int) -> None:
        x, y = (t.to(self.device) for t in validation_set())
        self.val_losses[epoch] = float(F.cross_entropy(self.model(x), y))

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            self._validate(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Four Gaussian blobs in 20 dimensions (the tutorial's MyTrainDataset has 20 too)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, 20, generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, 4, (n,), generator=g)
    return centres[y] + 1.5 * torch.randn(n, 20, generator=g), y


def validation_set() -> tuple[torch.Tensor, torch.Tensor]:
    return make_data(256, seed=2)


def load_train_objs() -> tuple[Dataset[Any], torch.nn.Module, torch.optim.Optimizer]:
    train_set = TensorDataset(*make_data(512, seed=1))  # load your dataset
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=5e-2, momentum=0.9)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset[Any], batch_size: int) -> DataLoader:
    return DataLoader(
        dataset,
        batch_size=batch_size,
        pin_memory=False,
        shuffle=False,
        sampler=DistributedSampler(dataset),
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    global ARGS
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument(
        "--batch_size", default=32, type=int, help="Input batch size on each device"
    )
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    parser.add_argument("--ddp", action="store_true", help="the DDP original (reference)")
    parser.add_argument("--strategy", default="allreduce", help="gradhub strategy")
    parser.add_argument("--servers", nargs="*", help="parameter-server addresses (ps-*)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ARGS = parser.parse_args(argv)

    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, ARGS.batch_size)
    trainer = Trainer(model, train_data, optimizer, ARGS.save_every, ARGS.snapshot_path)
    trainer.train(ARGS.total_epochs)
    destroy_process_group()
    return {"start_epoch": trainer.start_epoch, "val": trainer.val_losses}


if __name__ == "__main__":
    main()
