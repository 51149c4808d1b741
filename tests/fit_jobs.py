"""Jobs of the ``fit`` tests: every kind of data, output and loss (run in each rank)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import gradhub


def data(n: int = 24, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()


def mlp(out: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, out))


class DictItems(Dataset[dict[str, torch.Tensor]]):
    """A custom map-style dataset whose items are dicts."""

    def __init__(self) -> None:
        self.x, self.y = data()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"features": self.x[i], "labels": self.y[i]}


class PairItems(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        self.x, self.y = data()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        x, y = data()
        return iter(zip(x, y, strict=True))


class DictModel(nn.Module):
    """Takes a dict batch, returns a dict with logits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"logits": self.net(batch["features"])}


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 7) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, 8)
        self.out = nn.Linear(8, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(tokens)))  # (B, T, V)


def lm_data() -> tuple[torch.Tensor, torch.Tensor]:
    seq = torch.arange(24 * 5) % 7
    tokens = seq.reshape(24, 5)
    return tokens, (tokens + 1) % 7  # next token: learnable


def fit_kinds(rank: int, world: int) -> dict[str, Any]:
    runtime = gradhub.init(timeout=30)
    out: dict[str, Any] = {}

    def run(
        name: str, model: nn.Module, train: Any, strategy: str = "allreduce", **kw: Any
    ) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        if kw.pop("schedule", False):  # made before fit, on the script's optimizer
            kw["lr_scheduler"] = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
        with gradhub.DataParallelTrainer(model, opt, strategy=strategy, runtime=runtime) as trainer:
            kw.setdefault("batch_size", 8)
            result = trainer.fit(train, progress=False, **kw)
        losses = [h["train_loss"] for h in result.history]
        out[name] = (
            losses,
            result.train_accuracy,
            [p.detach().numpy().copy() for p in model.parameters()],
        )

    try:
        x, y = data()
        run("tensors", mlp(), (x, y), epochs=3)
        run("tensordataset", mlp(), TensorDataset(x, y), epochs=3)
        run("mapstyle", mlp(), PairItems(), epochs=3)
        run("dicts", DictModel(), DictItems(), epochs=3)
        run("iterable", mlp(), Stream(), epochs=3)
        run("loader", mlp(), DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True), epochs=3)
        run("lm", TinyLM(), lm_data(), epochs=3)
        run("scheduled allreduce", mlp(), (x, y), epochs=2, schedule=True)
        run("scheduled sharded", mlp(), (x, y), strategy="sharded", epochs=2, schedule=True)
        reg = (x, x[:, :1] * 2.0)
        run("regression", mlp(out=1), reg, epochs=3)
        run(
            "accumulate",
            mlp(),
            (x, y),
            epochs=3,
            batch_size=4,
            accumulate=2,
            grad_clip=10.0,
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 1.0),
        )
    finally:
        runtime.close()
    return out
