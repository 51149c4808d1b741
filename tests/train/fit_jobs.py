"""Jobs of the ``fit`` tests: every kind of data, output and loss (run in each rank)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, TensorDataset

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


class IdItems(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Map-style: ``(x, y, sample id)``, so a loss can record which samples it saw."""

    def __init__(self, n: int) -> None:
        self.x, self.y = data(n)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class IdStream(IterableDataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Iterable: ``(x, y, sample id)`` in order, the same sequence on every rank."""

    def __init__(self, n: int) -> None:
        self.x, self.y = data(n)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
        return iter(zip(self.x, self.y, range(len(self.x)), strict=True))


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


class ScoresModel(nn.Module):
    """Returns a dict whose logits are under a key the default loss does not know."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scores": self.net(x)}


def scores_loss(output: dict[str, torch.Tensor], batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(output["scores"], batch[1])


def error_rate(output: Any, batch: Any) -> float:
    """A metric callable: the share of wrong predictions (1 - accuracy)."""
    return float((output.argmax(-1) != batch[1]).float().mean())


def clipped_reference(
    max_norm: float, epochs: int, *, per_rank: bool = False
) -> tuple[list[Any], list[float]]:
    """One process, plain torch: fit's global batches of 8 (its seed-0 shuffle),
    ``clip_grad_norm_`` on the whole batch's gradient; (parameters, norms).
    ``per_rank``: the wrong clip instead, each rank's half by its own norm."""
    x, y = data()
    model = mlp()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.3)
    norms = []
    for epoch in range(epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for chunk in order.split(8):
            opt.zero_grad()
            if not per_rank:
                nn.functional.cross_entropy(model(x[chunk]), y[chunk]).backward()
                norms.append(float(nn.utils.clip_grad_norm_(params, max_norm)))
            else:
                halves = []
                for part in (chunk[0::2], chunk[1::2]):
                    grads = torch.autograd.grad(
                        nn.functional.cross_entropy(model(x[part]), y[part]), params
                    )
                    total = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
                    halves.append([g * min(1.0, max_norm / float(total)) for g in grads])
                for p, a, b in zip(params, *halves, strict=True):
                    p.grad = (a + b) / 2
            opt.step()
    return [p.detach().numpy().copy() for p in params], norms


def fit_kinds(rank: int, world: int) -> dict[str, Any]:
    runtime = gradhub.init(timeout=30)
    out: dict[str, Any] = {}
    extra: dict[str, Any] = {}  # what some runs report beyond (losses, accuracy, parameters)

    def run(
        name: str, model: nn.Module, train: Any, strategy: str = "allreduce", **kw: Any
    ) -> gradhub.FitResult:
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
        return result

    def recorder(calls: list[Any]) -> Any:
        return lambda epoch, record: calls.append((epoch, dict(record)))

    try:
        x, y = data()
        unused: list[Any] = []  # on_eval without eval_data: never called
        run("tensors", mlp(), (x, y), epochs=3, on_eval=recorder(unused))
        extra["on_eval without eval_data"] = unused
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
        epochs: list[Any] = []
        evals: list[Any] = []
        result = run(
            "metrics",
            mlp(),
            (x, y),
            epochs=3,
            eval_data=data(12, seed=2),
            metrics=["loss", "accuracy", error_rate],
            on_epoch=recorder(epochs),
            on_eval=recorder(evals),
        )
        extra["metrics"] = {"on_epoch": epochs, "on_eval": evals, "history": result.history}
        run("loss only", mlp(), (x, y), epochs=2, metrics=["loss"])
        run("custom loss", ScoresModel(), (x, y), epochs=3, loss_fn=scores_loss)
        # A clip that binds at every step (the global norm is 0.8 to 0.9).
        for strategy in ("allreduce", "sharded"):
            run(f"clip {strategy}", mlp(), (x, y), strategy=strategy, epochs=2, grad_clip=0.05)
        # Which samples each rank trained on, per epoch (ids recorded by the loss).
        for name, train in (
            ("ids iterable", IdStream(25)),  # 8, 8, 8, 1: rank 1 has none in the last
            ("ids loader over iterable", DataLoader(IdStream(25), batch_size=3)),
            ("ids loader", DataLoader(IdItems(24), batch_size=4, shuffle=True)),
            ("ids loader 25", DataLoader(IdItems(25), batch_size=4, shuffle=True)),
            # A DDP script's loader, unchanged: its DistributedSampler's shuffle is kept.
            (
                "ids ddp loader",
                DataLoader(IdItems(24), batch_size=4, sampler=DistributedSampler(IdItems(24))),
            ),
        ):
            ids: list[int] = []
            per_epoch: list[list[int]] = []

            def id_loss(output: torch.Tensor, batch: Any, ids: list[int] = ids) -> torch.Tensor:
                ids.extend(batch[2].tolist())
                return nn.functional.cross_entropy(output, batch[1])

            def cut(epoch: int, record: Any, ids: list[int] = ids, out: Any = per_epoch) -> None:
                out.append(list(ids))
                ids.clear()

            run(name, mlp(), train, epochs=2, loss_fn=id_loss, on_epoch=cut)
            extra[name] = per_epoch
        bf16 = mlp()
        run("bf16", bf16, (x, y), epochs=3, precision="bf16")
        extra["bf16 dtypes"] = sorted(
            {str(p.dtype) for p in bf16.parameters()}
            | {str(p.grad.dtype) for p in bf16.parameters() if p.grad is not None}
        )
    finally:
        runtime.close()
    return {"runs": out, "extra": extra}
