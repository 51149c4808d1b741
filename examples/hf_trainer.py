"""The Hugging Face Trainer on the "gradhub" torch.distributed backend.

    torchrun --nproc-per-node 2 examples/hf_trainer.py
    gradhub run -n 2 examples/hf_trainer.py

The one gradhub line is ``init_process_group("gradhub")``, before the
``TrainingArguments``: the Trainer builds its distributed state through
Accelerate, which takes the group it finds and wraps the model in DDP over it.
(``ddp_backend="gradhub"`` is refused: with ``use_cpu=True`` Accelerate
takes gloo or mpi only.) Nothing imports gradhub: its ``torch.backends``
entry point registers the backend at ``import torch``.

The model is a 2-layer GPT-2 built from its config (nothing to download). Each
sequence counts up modulo 16 from a random start in random steps of 1, 2 or 3:
the first token cannot be predicted and the second leaves the step open (one of
3), every later one follows from the two before. The best mean loss over the
15 predicted tokens is therefore ln(3) / 15 = 0.073; guessing gives ln(16) =
2.77, and a model that looks at one token only, about ln(3) = 1.1.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import math
from typing import Any

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

VOCAB, LENGTH, STEPS = 16, 16, (1, 2, 3)
BEST_LOSS = math.log(len(STEPS)) / (LENGTH - 1)


def make_data(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` counting sequences (generated, nothing to download)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    step = torch.tensor(STEPS)[torch.randint(0, len(STEPS), (n, 1), generator=g)]
    tokens = (start + step * torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": t, "labels": t} for t in tokens]


def digest(model: torch.nn.Module) -> str:
    """SHA-256 of the parameters' bytes: equal digests, equal bits."""
    data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    return hashlib.sha256(data).hexdigest()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--output-dir", default="runs/hf_trainer")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    dist.init_process_group("gradhub")  # before TrainingArguments
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,  # no dropout
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,  # GPT-2's special tokens are not in this vocabulary
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    training = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=True,
        max_steps=args.steps,
        per_device_train_batch_size=16,
        learning_rate=1e-2,
        warmup_steps=10,
        logging_steps=20,
        ddp_find_unused_parameters=False,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=make_data(2048, seed=0),
        eval_dataset=make_data(256, seed=1),
    )
    trainer.train()
    loss = trainer.evaluate()["eval_loss"]  # the held-out mean over every rank

    replicas: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(replicas, digest(model))
    out = {
        "loss": loss,
        "backend": dist.get_backend(trainer.model_wrapped.process_group),
        "ddp": type(trainer.model_wrapped).__name__,
        "digest": digest(model),
        "replicas": replicas,
    }
    if dist.get_rank() == 0:
        logging.info(
            "%s on %r, %d ranks: held-out loss %.4f (best possible %.4f); replicas identical: %s",
            out["ddp"],
            out["backend"],
            len(replicas),
            loss,
            BEST_LOSS,
            len(set(replicas)) == 1,
        )
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    main()
