"""A character language model (a small transformer, ~1M parameters) trained with ``fit``.

    gradhub run -n 2 examples/charlm.py
    gradhub run -n 2 examples/charlm.py --strategy sharded
    python examples/charlm.py --device cpu                  # one process, on the CPU
    gradhub run -n 2 --servers 1 --ps-mode sync examples/charlm.py --strategy ps-sync

The text is generated (seeded sentences from a small grammar, nothing to
download). Batches are dicts (``{"tokens", "targets"}``) and the model
returns a dict (``{"logits": (B, T, V), "loss": ...}``): ``fit`` takes the
loss from it and reports per-character accuracy. The model goes to
``--device`` (default: this rank's GPU where CUDA is, else the CPU); ``fit``
puts each batch where the model is.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

import gradhub
from gradhub.errors import RunFolderExistsError

_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher"]
_VERBS = ["sees", "likes", "finds", "follows", "draws", "remembers"]
_OBJECTS = ["the river", "a red ball", "the garden", "an open door", "the moon", "a long road"]


def make_text(sentences: int = 4000, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}."
        for _ in range(sentences)
    )


class Chunks(Dataset[dict[str, torch.Tensor]]):
    """Windows of ``length + 1`` characters: tokens and the next-character targets."""

    def __init__(self, text: str, length: int) -> None:
        self.vocab = sorted(set(text))
        ids = torch.tensor([self.vocab.index(c) for c in text])
        n = (len(ids) - 1) // length
        self.x = ids[: n * length].reshape(n, length)
        self.y = ids[1 : n * length + 1].reshape(n, length)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": self.x[i], "targets": self.y[i]}


class CharLM(nn.Module):
    def __init__(self, vocab: int, length: int, width: int = 128, layers: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(length, width))
        layer = nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=4 * width, dropout=0.0, batch_first=True
        )
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        tokens = batch["tokens"]
        t = tokens.shape[1]
        h = self.tok(tokens) + self.pos[:t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())
        return {"logits": logits, "loss": loss}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strategy", default="allreduce", help="allreduce, sharded, ps-async, ...")
    p.add_argument("--servers", nargs="*", help="parameter-server addresses (ps-* strategies)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--sentences", type=int, default=4000)
    p.add_argument("--length", type=int, default=64, help="characters per sample")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="global batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--run-dir", default=None, help="metrics (gradhub plot it)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    runtime = gradhub.init()
    data = Chunks(make_text(args.sentences), args.length)
    cut = len(data) * 9 // 10
    train = torch.utils.data.Subset(data, range(cut))
    held_out = torch.utils.data.Subset(data, range(cut, len(data)))
    torch.manual_seed(0)
    model = CharLM(len(data.vocab), args.length, args.width, args.layers)
    model.to(runtime.local_device(args.device))  # cuda: the GPU LOCAL_RANK picks
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    options = {"servers": args.servers} if args.servers else {}
    if runtime.is_main:
        size = sum(p.numel() for p in model.parameters())
        logging.info("char LM: %d parameters, %d samples", size, len(train))
    with gradhub.DataParallelTrainer(
        model, optimizer, strategy=args.strategy, runtime=runtime, **options
    ) as trainer:
        first: list[float] = []
        result = trainer.fit(
            train,
            eval_data=held_out,
            epochs=args.epochs,
            batch_size=args.batch_size,
            grad_clip=1.0,
            run_dir=args.run_dir,
            progress=runtime.is_main,
            on_step=lambda step, record: first.append(record["loss"]) if step <= 3 else None,
        )
    runtime.close()
    if runtime.is_main:
        logging.info(
            "eval loss %.3f (chance %.3f), per-character accuracy %.3f",
            result.eval_loss or math.nan,
            math.log(len(data.vocab)),
            result.eval_accuracy or math.nan,
        )
    return {"first": sum(first) / len(first), "last": result.eval_loss, "result": result}


if __name__ == "__main__":
    try:
        main()
    except RunFolderExistsError as exc:  # a second run into --run-dir: one line
        if os.environ.get("RANK", "0") == "0":  # every rank raises it; rank 0 says so
            print(f"charlm.py: error: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(2)
