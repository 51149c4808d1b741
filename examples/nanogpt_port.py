"""nanoGPT's ``train.py``, ported to gradhub by changing the init and wrap lines only.

A small copy of the structure of karpathy/nanoGPT's training script on a
tiny character-level GPT (``nanogpt_model.py``) over a text generated here
(nothing to download): gradient accumulation through
``model.require_backward_grad_sync``, ``torch.amp.GradScaler``, torch's
``clip_grad_norm_`` on ``model.parameters()``, AdamW with decay and
no-decay groups, cosine LR with warmup set on ``param_groups``, evaluation
on rank 0 under ``no_grad``, a rank-0 checkpoint with the optimizer state
and ``--init_from resume`` loading it before the wrap.

    gradhub run -n 2 examples/nanogpt_port.py --strategy sharded --out_dir out
    gradhub run -n 2 --servers 1 --ps-mode sync examples/nanogpt_port.py --strategy ps-sync
    torchrun --nproc-per-node 2 examples/nanogpt_port.py --ddp        # the DDP original

The two lines that differ from the DDP script are marked ``# gradhub``;
``--ddp`` runs the original lines instead (plain DDP), so the same script
gives the reference. ``--device cuda`` (the default where CUDA is) runs as
nanoGPT does on GPUs: NCCL, one GPU per rank; ``--device cpu`` on gloo.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from nanogpt_model import GPT, GPTConfig
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

import gradhub


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ddp", action="store_true", help="the DDP original (reference)")
    p.add_argument("--strategy", default="allreduce", help="gradhub strategy")
    p.add_argument("--servers", nargs="*", help="parameter-server addresses (ps-*)")
    p.add_argument("--out_dir", default="out-nanogpt-port")
    p.add_argument("--eval_interval", type=int, default=10)
    p.add_argument("--log_interval", type=int, default=5)
    p.add_argument("--eval_iters", type=int, default=8)
    p.add_argument("--always_save_checkpoint", action="store_true")
    p.add_argument("--init_from", default="scratch", choices=["scratch", "resume"])
    p.add_argument("--gradient_accumulation_steps", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--block_size", type=int, default=32)
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_head", type=int, default=2)
    p.add_argument("--n_embd", type=int, default=32)
    p.add_argument("--learning_rate", type=float, default=1e-2)
    p.add_argument("--max_iters", type=int, default=40)
    p.add_argument("--weight_decay", type=float, default=1e-1)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--warmup_iters", type=int, default=4)
    p.add_argument("--lr_decay_iters", type=int, default=40)
    p.add_argument("--min_lr", type=float, default=1e-3)
    p.add_argument("--dtype", default="float16", help="float16 turns the GradScaler on")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def char_dataset(n_chars: int = 60000) -> tuple[np.ndarray, np.ndarray, int]:
    """A small text from a fixed grammar, encoded per character, split 90/10
    (nanoGPT's shakespeare_char prepare.py makes train.bin and val.bin the same way)."""
    rng = np.random.default_rng(0)
    subjects = ["the cat", "a dog", "my friend", "the old king", "her brother", "our teacher"]
    verbs = ["sees", "likes", "finds", "follows", "helps", "calls"]
    objects = ["the river", "a small bird", "the red house", "his sister", "the garden"]
    parts: list[str] = []
    while sum(map(len, parts)) < n_chars:
        parts.append(
            f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}"
            f"{rng.choice(['.', '!', ' again.', ' today.'])}\n"
        )
    text = "".join(parts)[:n_chars]
    chars = sorted(set(text))
    stoi = {ch: i for i, ch in enumerate(chars)}
    data = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = int(0.9 * len(data))
    return data[:n], data[n:], len(chars)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    out_dir = args.out_dir
    gradient_accumulation_steps = args.gradient_accumulation_steps
    batch_size, block_size = args.batch_size, args.block_size
    learning_rate, max_iters = args.learning_rate, args.max_iters
    grad_clip, dtype = args.grad_clip, args.dtype
    device = args.device
    backend = "nccl" if device == "cuda" else "gloo"

    # various inits, derived attributes, I/O setup
    ddp = int(os.environ.get("RANK", -1)) != -1  # is this a ddp run?
    if ddp:
        if args.ddp:
            init_process_group(backend=backend)
        else:
            gradhub.init(backend=backend)  # gradhub
        ddp_rank = int(os.environ["RANK"])
        ddp_world_size = int(os.environ["WORLD_SIZE"])
        if device == "cuda":  # nanoGPT: f"cuda:{ddp_local_rank}"
            device = f"cuda:{int(os.environ['LOCAL_RANK']) % torch.cuda.device_count()}"
            torch.cuda.set_device(device)
        master_process = ddp_rank == 0  # this process will do logging, checkpointing etc.
        seed_offset = ddp_rank  # each process gets a different seed
        assert gradient_accumulation_steps % ddp_world_size == 0
        gradient_accumulation_steps //= ddp_world_size
    else:
        master_process = True
        seed_offset = 0
        ddp_world_size = 1
    tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
    if master_process:
        print(f"tokens per iteration will be: {tokens_per_iter:,}")
        os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(1337 + seed_offset)
    device_type = "cuda" if "cuda" in device else "cpu"
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        dtype
    ]
    ctx = (
        nullcontext()
        if device_type == "cpu"
        else torch.amp.autocast(device_type=device_type, dtype=ptdtype)
    )

    train_data, val_data, meta_vocab_size = char_dataset()

    def get_batch(split: str) -> tuple[torch.Tensor, torch.Tensor]:
        data = train_data if split == "train" else val_data
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy(data[i : i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack(
            [torch.from_numpy(data[i + 1 : i + 1 + block_size].astype(np.int64)) for i in ix]
        )
        return x.to(device), y.to(device)

    iter_num = 0
    best_val_loss = 1e9

    model_args = dict(
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        block_size=block_size,
        bias=False,
        vocab_size=None,
        dropout=0.0,
    )
    if args.init_from == "scratch":
        model_args["vocab_size"] = meta_vocab_size
        model = GPT(GPTConfig(**model_args))  # type: ignore[arg-type]
    else:  # resume
        ckpt_path = os.path.join(out_dir, "ckpt.pt")
        checkpoint = torch.load(ckpt_path, map_location=device)
        checkpoint_model_args = checkpoint["model_args"]
        for k in ["n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size"]:
            model_args[k] = checkpoint_model_args[k]
        model = GPT(GPTConfig(**model_args))  # type: ignore[arg-type]
        state_dict = checkpoint["model"]
        unwanted_prefix = "_orig_mod."
        for k in list(state_dict.keys()):
            if k.startswith(unwanted_prefix):
                state_dict[k[len(unwanted_prefix) :]] = state_dict.pop(k)
        model.load_state_dict(state_dict)
        iter_num = checkpoint["iter_num"]
        best_val_loss = checkpoint["best_val_loss"]
    start_iter = iter_num
    model.to(device)

    # the GradScaler is on for float16 (nanoGPT: torch.cuda.amp.GradScaler; on CPU, "cpu")
    scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))

    optimizer = model.configure_optimizers(
        args.weight_decay, learning_rate, (0.9, 0.99), device_type
    )
    if args.init_from == "resume":
        optimizer.load_state_dict(checkpoint["optimizer"])
    checkpoint = None  # free up memory

    # wrap model into DDP container
    if ddp:
        if args.ddp:
            model = DDP(model)
        else:
            servers = {"servers": args.servers} if args.servers else {}
            model, optimizer = gradhub.prepare(
                model, optimizer, strategy=args.strategy, **servers
            )  # gradhub

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(args.eval_iters)
            for k in range(args.eval_iters):
                X, Y = get_batch(split)
                with ctx:
                    logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = float(losses.mean())
        model.train()
        return out

    def get_lr(it: int) -> float:
        if it < args.warmup_iters:
            return learning_rate * (it + 1) / (args.warmup_iters + 1)
        if it > args.lr_decay_iters:
            return args.min_lr
        decay_ratio = (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters)
        assert 0 <= decay_ratio <= 1
        coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
        return args.min_lr + coeff * (learning_rate - args.min_lr)

    # training loop
    val_losses: dict[int, float] = {}
    X, Y = get_batch("train")
    t0 = time.time()
    raw_model = model.module if ddp else model  # unwrap DDP container if needed
    while True:
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr

        # evaluate the loss on train/val sets and write checkpoints
        if iter_num % args.eval_interval == 0 and master_process:
            losses = estimate_loss()
            val_losses[iter_num] = losses["val"]
            print(
                f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
            )
            if losses["val"] < best_val_loss or args.always_save_checkpoint:
                best_val_loss = losses["val"]
                if iter_num > 0:
                    checkpoint = {
                        "model": raw_model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "model_args": model_args,
                        "iter_num": iter_num,
                        "best_val_loss": best_val_loss,
                        "config": {k: v for k, v in vars(args).items() if k != "servers"},
                    }
                    print(f"saving checkpoint to {out_dir}")
                    torch.save(checkpoint, os.path.join(out_dir, "ckpt.pt"))

        # forward backward update, with optional gradient accumulation
        for micro_step in range(gradient_accumulation_steps):
            if ddp:
                # in DDP training we only need to sync gradients at the last micro step
                model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch("train")
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num % args.log_interval == 0 and master_process:
            lossf = loss.item() * gradient_accumulation_steps
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms")
        iter_num += 1

        if iter_num > max_iters:
            break

    if ddp:
        destroy_process_group()
    return {"start_iter": start_iter, "iter_num": iter_num, "val": val_losses}


if __name__ == "__main__":
    main()
