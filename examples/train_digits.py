"""Train an MLP on scikit-learn's digits with gradhub, on any number of processes.

    gradhub run -n 4 examples/train_digits.py
    gradhub run -n 4 examples/train_digits.py --compress powersgd
    torchrun --nproc-per-node 4 examples/train_digits.py
    gradhub run -n 4 --servers 1 --ps-mode sync --ps-lr 0.05 --ps-momentum 0.9 \\
        examples/train_digits.py --strategy ps-sync
    gradhub run -n 4 --max-restarts 2 examples/train_digits.py --run-dir runs/digits
    python examples/train_digits.py            # one process
    python examples/train_digits.py --device cpu

Every process runs this same script; ``gradhub.init()`` reads the launcher's
environment and ``fit`` splits each batch over the processes and puts each
part where the model is (``--device``: this rank's GPU where CUDA is, else the CPU). With
``--max-restarts``, give a ``--run-dir`` of your own: restarted workers resume
from the checkpoints in it (the default folder, ``runs/train_digits-TIME``, is
named by rank 0's clock when the ranks start, the same folder for every rank
of one attempt, but another one after a restart). Running again into a run
folder that holds a run, finished or killed, is an error (also under
``--max-restarts``, on every attempt); ``--resume`` continues it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import torch
from sklearn.datasets import load_digits

import gradhub
from gradhub.errors import RunFolderExistsError, SecretFileError
from gradhub.ps.secret import read_secret_file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--strategy", default="allreduce", help="allreduce, sharded, ps-async, ...")
    p.add_argument("--servers", nargs="*", help="parameter-server addresses (ps-* strategies)")
    p.add_argument("--secret-file", help="the parameter servers' shared secret (ps-* strategies)")
    p.add_argument("--compress", help="gradient compression: bf16, fp16, powersgd (allreduce)")
    p.add_argument("--powersgd-rank", type=int, default=4, help="rank of PowerSGD's approximation")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64, help="global batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument(
        "--run-dir",
        help="metrics (gradhub plot it); a new folder, or the old one with --resume "
        "(default: runs/train_digits-TIME)",
    )
    p.add_argument("--checkpoint-dir", help="write checkpoints here")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    secret = read_secret_file(args.secret_file) if args.secret_file else None

    runtime = gradhub.init()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]

    torch.manual_seed(0)  # rank 0's initial weights are broadcast anyway
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    model.to(runtime.local_device(args.device))  # cuda: the GPU LOCAL_RANK picks
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    options: dict[str, object] = {"servers": args.servers} if args.servers else {}
    if secret is not None:
        options["secret"] = secret
    if args.compress:
        options["compress"] = args.compress
    if args.compress == "powersgd":
        options["compress_options"] = {"rank": args.powersgd_rank}
    with gradhub.DataParallelTrainer(
        model, optimizer, strategy=args.strategy, runtime=runtime, **options
    ) as trainer:
        result = trainer.fit(
            (x[train], y[train]),
            eval_data=(x[test], y[test]),
            epochs=args.epochs,
            batch_size=args.batch_size,
            run_dir=args.run_dir or default_run_dir(runtime),
            checkpoint_dir=args.checkpoint_dir,
            resume=args.resume,
        )
    if runtime.is_main:
        logging.info(
            "%s on %d process(es): test accuracy %.2f%%, %.0f samples/s",
            result.strategy,
            result.world_size,
            100 * (result.eval_accuracy or 0.0),
            result.samples_per_s,
        )
    runtime.close()


def default_run_dir(runtime: gradhub.Runtime) -> str:
    """``runs/train_digits-TIME`` by rank 0's clock, one folder for every rank."""
    start = torch.tensor([time.time() if runtime.is_main else 0.0], dtype=torch.float64)
    start = runtime.all_reduce_sum(start, where="the run folder's name")
    return time.strftime("runs/train_digits-%Y%m%d-%H%M%S", time.localtime(start.item()))


if __name__ == "__main__":
    try:
        main()
    except (RunFolderExistsError, SecretFileError) as exc:  # one line, not a traceback
        if os.environ.get("RANK", "0") == "0":  # every rank raises it; rank 0 says so
            print(f"train_digits.py: error: {' '.join(str(exc).split())}", file=sys.stderr)
        sys.exit(2)
