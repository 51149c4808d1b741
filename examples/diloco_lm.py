"""A small GPT trained on the Python standard library's source, under ``allreduce`` or DiLoCo.

    gradhub run -n 4 examples/diloco_lm.py --strategy allreduce --run-dir runs/allreduce
    gradhub run -n 4 examples/diloco_lm.py --strategy diloco --inner-steps 50 --run-dir runs/h50
    gradhub run -n 4 examples/diloco_lm.py --strategy diloco --inner-steps 100 \\
        --fragments 4 --overlap 2 --compress fp4 --run-dir runs/streaming
    gradhub run -n 4 --servers 1 --ps-mode sync examples/diloco_lm.py --strategy diloco \\
        --inner-steps 50 --servers --run-dir runs/servers
    gradhub plot runs        # validation loss against samples and against bytes sent

The corpus is the ``.py`` files next to ``os.py`` on this machine (sorted by
name, read as bytes: a byte-level model, vocabulary 256, nothing to
download); its first 90 % trains, the last 10 % validates. The model is
``nanogpt_model.GPT`` (4 layers of width 256 by default: 3.2M parameters).
Each worker draws its own random windows of ``--seq`` bytes (``--batch`` per
worker per step), so every strategy sees the same samples for the same
``--steps``: ``steps * batch * world``.

A plain loop through :func:`gradhub.prepare`; the only line that differs
between the strategies is the ``prepare`` call's options. Rank 0 writes JSON
lines to ``--run-dir/metrics.rank0.jsonl``: ``"step"`` records (training
loss) and ``"eval"`` records with ``eval_loss`` (rank 0's model on fixed
validation windows; under ``diloco`` its own weights, equal to the others'
right after a sync of every fragment), ``samples`` (seen by all workers) and
``bytes_sent`` (by each worker, counted by :class:`Traffic`).
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
from pathlib import Path
from typing import Any

import torch
from nanogpt_model import GPT, GPTConfig

import gradhub
from gradhub.train.metrics import MetricsWriter
from gradhub.train.strategies.diloco.fragments import cut, offsets


def corpus(limit: int | None = None) -> torch.Tensor:
    """The standard library's top-level ``.py`` files, sorted, as one uint8 tensor."""
    folder = Path(os.path.dirname(os.__file__))
    data = b"\n".join(p.read_bytes() for p in sorted(folder.glob("*.py")))
    return torch.frombuffer(bytearray(data[:limit]), dtype=torch.uint8)


def ring_bytes(numel: int, world: int) -> float:
    """Bytes each rank sends in a ring all-reduce of ``numel`` fp32 values."""
    return 2 * (world - 1) / world * 4 * numel


def powersgd_numel(shapes: list[torch.Size]) -> int:
    """Values PowerSGD (rank 1, the defaults of
    :mod:`gradhub.train.reducers.powersgd`) all-reduces per step: ``rows +
    cols`` per matrix worth compressing, every value otherwise
    (a quarter of what its ``bytes_reduced`` counts, the same number)."""
    total = 0
    for shape in shapes:
        n = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else 0
        cols = n // rows if rows else 0
        worth = rows and (rows + cols) * 2 < n  # min_compression_rate 2
        total += rows + cols if worth else n
    return total


def sync_bytes(numel: int, world: int, compress: str) -> float:
    """Bytes each rank sends in one DiLoCo exchange of ``numel`` values (README,
    "Slow links: DiLoCo"): fp32 ring all-reduce, or the all-gather of the wire."""
    if compress == "none":
        return ring_bytes(numel, world)
    if compress == "bf16":
        return (world - 1) * 2 * numel
    if compress == "fp4":
        return (world - 1) * (0.625 * numel + 16)
    raise ValueError(f"no byte count for compress={compress!r}")


class Traffic:
    """The bytes this worker has sent so far, from the strategy's exchange:
    the ring's count worked out from the algorithm, not measured on the
    transport (on one host the shared-memory transport moves the same values
    through memory; between hosts a ring sends these bytes). ``allreduce``:
    every step, the whole gradient (or PowerSGD's factors); ``diloco``: at
    each fragment's sync step, that fragment (the 12-byte weight tally
    behind it left out)."""

    def __init__(self, shapes: list[torch.Size], world: int, args: argparse.Namespace) -> None:
        sizes = [math.prod(s) for s in shapes]
        self.sent = 0.0
        self.per_step = 0.0
        self.at_offset: dict[int, float] = {}
        self.inner_steps = args.inner_steps
        if args.strategy == "allreduce":  # fp32 buckets, 16-bit ones or PowerSGD's factors
            numel = powersgd_numel(shapes) if args.compress == "powersgd" else sum(sizes)
            half = args.compress in ("bf16", "fp16")
            self.per_step = ring_bytes(numel, world) / (2 if half else 1)
        else:
            parts = cut(sizes, args.fragments)
            for offset, part in zip(offsets(args.inner_steps, args.fragments), parts, strict=True):
                numel = sum(sizes[i] for i in part)
                self.at_offset[offset] = sync_bytes(numel, world, args.compress)

    def step(self, n: int) -> None:
        """Count optimizer step ``n`` (1, 2, ...)."""
        self.sent += self.per_step + self.at_offset.get(n % self.inner_steps, 0.0)


def options(args: argparse.Namespace) -> dict[str, Any]:
    """``prepare``'s options for ``--strategy`` (the one place the strategies differ)."""
    if args.strategy == "allreduce":
        return {"compress": args.compress}
    outer = functools.partial(
        torch.optim.SGD,
        lr=args.outer_lr,
        momentum=args.outer_momentum,
        nesterov=args.outer_momentum > 0,
    )
    return {
        "inner_steps": args.inner_steps,
        "fragments": args.fragments,
        "overlap": args.overlap,
        "compress": args.compress,
        "servers": True if args.servers else None,
        "diloco_mode": args.diloco_mode,
        "outer_optimizer": outer,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strategy", default="diloco", choices=["allreduce", "diloco"])
    p.add_argument("--inner-steps", type=int, default=50, help="diloco: H")
    p.add_argument("--fragments", type=int, default=1, help="diloco: F (streaming)")
    p.add_argument("--overlap", type=int, default=0, help="diloco: tau (streaming)")
    p.add_argument(
        "--compress",
        default="none",
        help="allreduce: none, bf16, powersgd; diloco: none, bf16, fp4",
    )
    p.add_argument(
        "--servers",
        action="store_true",
        help="diloco: the shared weights and the outer optimizer on the parameter servers\n"
        "`gradhub run --servers S --ps-mode sync` started (ssp for --diloco-mode async);\n"
        "bytes_sent counts no server traffic then",
    )
    p.add_argument(
        "--diloco-mode", default="sync", choices=["sync", "async"], help="diloco: with --servers"
    )
    p.add_argument("--outer-lr", type=float, default=0.7, help="diloco: outer SGD's lr")
    p.add_argument(
        "--outer-momentum", type=float, default=0.9, help="diloco: outer SGD's Nesterov momentum"
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps per worker")
    p.add_argument("--batch", type=int, default=16, help="windows per worker per step")
    p.add_argument("--seq", type=int, default=128, help="bytes per window")
    p.add_argument("--lr", type=float, default=1e-3, help="inner (AdamW) learning rate")
    p.add_argument("--eval-every", type=int, default=100, help="steps between evaluations")
    p.add_argument("--eval-windows", type=int, default=64, help="validation windows")
    p.add_argument("--corpus-bytes", type=int, default=None, help="use the first N bytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", type=Path, default=None, help="metrics (gradhub plot it)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


@torch.no_grad()
def evaluate(model: torch.nn.Module, val: torch.Tensor, seq: int, windows: int) -> float:
    """Mean loss on ``windows`` evenly spaced windows of the validation bytes."""
    starts = torch.linspace(0, len(val) - seq - 2, windows).long()
    x = torch.stack([val[s : s + seq] for s in starts]).long()
    y = torch.stack([val[s + 1 : s + seq + 1] for s in starts]).long()
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    losses = [
        model(x[i : i + 16].to(device), y[i : i + 16].to(device))[1] for i in range(0, windows, 16)
    ]
    model.train(was_training)
    return float(torch.stack([loss for loss in losses if loss is not None]).mean())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    runtime = gradhub.init()
    data = corpus(args.corpus_bytes)
    split = len(data) * 9 // 10
    train, val = data[:split], data[split:]
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    config = GPTConfig(
        block_size=args.seq,
        vocab_size=256,
        n_layer=args.layers,
        n_head=max(1, args.width // 64),
        n_embd=args.width,
    )
    model = GPT(config).to(runtime.local_device(args.device))
    raw = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    model, optimizer = gradhub.prepare(model, optimizer, strategy=args.strategy, **options(args))
    traffic = Traffic([p.shape for p in raw.parameters()], runtime.world_size, args)
    writer = MetricsWriter(args.run_dir if runtime.is_main else None, runtime.rank)
    if runtime.is_main:
        size = sum(p.numel() for p in raw.parameters())
        logging.info("GPT: %d parameters; %d training bytes", size, len(train))
    draw = torch.Generator().manual_seed(args.seed * 1000 + runtime.rank)  # own windows
    device = next(raw.parameters()).device
    warmup = max(1, args.steps // 20)
    first = last = math.nan
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(train) - args.seq - 1, (args.batch,), generator=draw)
        x = torch.stack([train[s : s + args.seq] for s in starts]).long().to(device)
        y = torch.stack([train[s + 1 : s + args.seq + 1] for s in starts]).long().to(device)
        for group in optimizer.param_groups:  # linear warmup, cosine to 10 %
            progress = max(0.0, (step - warmup) / max(1, args.steps - warmup))
            scale = min(1.0, step / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))
            group["lr"] = args.lr * scale
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        traffic.step(step)
        samples = step * args.batch * runtime.world_size
        if runtime.is_main and (step % args.eval_every == 0 or step == args.steps or step == 1):
            last = evaluate(raw, val, args.seq, args.eval_windows)
            first = last if step == 1 else first
            writer.write("step", step=step, loss=float(loss.detach()))
            writer.write(
                "eval", step=step, samples=samples, bytes_sent=traffic.sent, eval_loss=last
            )
            logging.info("step %d: validation loss %.3f, %.3g bytes sent", step, last, traffic.sent)
    model.close()  # waits for an overlapped exchange still in flight
    writer.close()
    runtime.close()
    return {"first": first, "last": last, "bytes_sent": traffic.sent, "samples": samples}


if __name__ == "__main__":
    main()
