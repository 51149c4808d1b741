"""DiLoCo against ``allreduce``: validation loss and bytes sent, for the same samples.

The model and the loop are ``examples/diloco_lm.py`` (a byte-level GPT on the
Python standard library's source), run by its ``main`` on 4 ranks in one
process group (``local_group`` on 127.0.0.1, gloo, one intra-op thread per
rank; on a 2-core machine the 4 ranks time-slice, so the wall times say
little and only the losses and bytes are compared). Every setting runs the
same ``--steps`` with the same per-worker batch, from the same initial
weights and the same per-rank data order, so each sees the same samples:

- ``allreduce``: the gradient averaged every step (DDP's arithmetic), the peer;
- ``allreduce powersgd``: the same with ``compress="powersgd"`` (rank 1);
- ``diloco H=...``: ``strategy="diloco"`` with ``inner_steps=H`` (the outer
  optimizer is the default: SGD, lr 0.7, Nesterov momentum 0.9);
- ``streaming F=4 ...``: ``fragments=4`` with ``compress="bf16"`` / ``"fp4"``;
- ``... outer-lr=...``, ``... outer-momentum=...``: the outer SGD's lr
  instead of 0.7, its Nesterov momentum instead of 0.9;
- ``... lr=...``: the inner (AdamW) learning rate instead of the example's 1e-3
  (warmup and cosine decay to 10 % as always), ``allreduce`` too, so that its
  loss at that lr is beside them; the ratios stay against ``allreduce`` at
  1e-3, the example's default.

For each: the validation loss of rank 0's model after the last step (the
example's fixed validation windows) and its ratio to ``allreduce``'s, and the
bytes each worker sent (the example's ``Traffic``: the ring's count worked out
from each strategy's exchange, not measured on the transport) and their ratio
to ``allreduce``'s. The frontier is the setting with the fewest bytes whose
loss is within 2 % of ``allreduce``'s. One run per setting (no repeats: the
spread between seeds is not measured). Writes ``diloco.json`` and
``diloco.md`` to ``--out``.

    python benchmarks/diloco.py [--steps 1000] [--width 64] [--layers 2] [--settings ...]

``--peer SETTING`` (default ``allreduce``): the setting the "vs allreduce"
ratios and the frontier are taken against, run first (e.g. ``"allreduce
lr=4e-3"``, a tuned peer; ``results/diloco-horizon.md`` ran 4000 steps so).

The last record ran ``--steps 1000`` with the settings its table lists.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import gradhub
from _common import RESULTS, machine_note, rank_zero_result, write_results
from gradhub.collective import local_group

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
WORLD_SIZE = 4
PEER = "allreduce"
SETTINGS: dict[str, list[str]] = {
    PEER: ["--strategy", "allreduce"],
    "allreduce powersgd": ["--strategy", "allreduce", "--compress", "powersgd"],
    **{
        f"diloco H={h}": ["--strategy", "diloco", "--inner-steps", str(h)]
        for h in (10, 50, 100, 500)
    },
    **{
        f"streaming H=100 F=4 {c}": [
            "--strategy", "diloco", "--inner-steps", "100", "--fragments", "4", "--compress", c
        ]
        for c in ("bf16", "fp4")
    },
    # A higher inner lr (AdamW, warmup + cosine to 10 %): each worker steps on a
    # quarter of allreduce's batch. The peer at the same lr beside them.
    "allreduce lr=4e-3": ["--strategy", "allreduce", "--lr", "4e-3"],
    "allreduce lr=8e-3": ["--strategy", "allreduce", "--lr", "8e-3"],
    **{
        f"diloco H=100 lr={lr}": ["--strategy", "diloco", "--inner-steps", "100", "--lr", lr]
        for lr in ("2e-3", "4e-3", "8e-3")
    },
    **{
        f"diloco H=100 outer-lr={olr}": [
            "--strategy", "diloco", "--inner-steps", "100", "--outer-lr", olr
        ]
        for olr in ("0.4", "1.0")
    },
    "diloco H=100 lr=4e-3 outer-momentum=0.8": [
        "--strategy", "diloco", "--inner-steps", "100", "--lr", "4e-3", "--outer-momentum", "0.8"
    ],
    "streaming H=32 F=4 fp4 lr=4e-3": [
        "--strategy", "diloco", "--inner-steps", "32", "--fragments", "4", "--compress", "fp4",
        "--lr", "4e-3",
    ],
    # 100x fewer bytes by syncing twice as often in half the bits, or 4x as often in fp4.
    **{
        f"diloco H=50 bf16 lr=4e-3{tail}": [
            "--strategy", "diloco", "--inner-steps", "50", "--compress", "bf16", "--lr", "4e-3",
            *extra,
        ]
        for tail, extra in (("", []), (" outer-momentum=0.8", ["--outer-momentum", "0.8"]))
    },
    **{
        f"diloco H=100 lr=4e-3 outer-momentum={m}": [
            "--strategy", "diloco", "--inner-steps", "100", "--lr", "4e-3", "--outer-momentum", m
        ]
        for m in ("0.6", "0.7")
    },
    "diloco H=200 lr=4e-3 outer-momentum=0.6": [
        "--strategy", "diloco", "--inner-steps", "200", "--lr", "4e-3", "--outer-momentum", "0.6"
    ],
    "streaming H=100 F=4 fp4 lr=4e-3 outer-momentum=0.6": [
        "--strategy", "diloco", "--inner-steps", "100", "--fragments", "4", "--compress", "fp4",
        "--lr", "4e-3", "--outer-momentum", "0.6",
    ],
    **{
        f"diloco H=50 fp4 lr=4e-3 outer-momentum={m}": [
            "--strategy", "diloco", "--inner-steps", "50", "--compress", "fp4", "--lr", "4e-3",
            "--outer-momentum", m,
        ]
        for m in ("0.6", "0.8")
    },
    "diloco H=100 lr=8e-3 outer-momentum=0.6": [
        "--strategy", "diloco", "--inner-steps", "100", "--lr", "8e-3", "--outer-momentum", "0.6"
    ],
    "streaming H=16 F=4 fp4 lr=4e-3": [
        "--strategy", "diloco", "--inner-steps", "16", "--fragments", "4", "--compress", "fp4",
        "--lr", "4e-3",
    ],
}  # fmt: skip
TOLERANCE = 0.02  # within 2 % of allreduce's validation loss


def rank_main(
    rank: int, port: int, settings: list[str], model: list[str], run_dir: str, queue: Any
) -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, str(EXAMPLES))
    import diloco_lm

    with local_group(rank, WORLD_SIZE, port, timeout=600), gradhub.init(timeout=600):
        report = {}  # one process group for every setting: the example's init() adopts it
        for name in settings:
            begin = time.perf_counter()
            folder = f"{run_dir}/{name.replace(' ', '_')}"
            out = diloco_lm.main([*SETTINGS[name], *model, "--run-dir", folder])
            report[name] = {**out, "seconds": time.perf_counter() - begin}
        if rank == 0:
            queue.put(report)


def summarise(report: dict[str, Any], peer_name: str = PEER) -> list[dict[str, Any]]:
    peer = report[peer_name]
    return [
        {
            "setting": name,
            "val_loss": r["last"],
            "loss_vs_allreduce": r["last"] / peer["last"],
            "bytes_sent": r["bytes_sent"],
            "bytes_vs_allreduce": r["bytes_sent"] / peer["bytes_sent"],
            "samples": r["samples"],
            "seconds": r["seconds"],
        }
        for name, r in report.items()
    ]


def frontier(rows: list[dict[str, Any]]) -> str | None:
    """The setting with the fewest bytes within ``TOLERANCE`` of allreduce's loss."""
    kept = [r for r in rows if r["loss_vs_allreduce"] <= 1 + TOLERANCE]
    return min(kept, key=lambda r: r["bytes_sent"])["setting"] if kept else None


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| setting | validation loss | vs allreduce | bytes sent per worker | vs allreduce "
        "| wall s (4 ranks on the cores) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['val_loss']:.4f} | {r['loss_vs_allreduce']:.3f}x "
            f"| {r['bytes_sent'] / 1e6:,.2f} MB | {r['bytes_vs_allreduce']:.4f}x "
            f"| {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per worker")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="windows per worker per step")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated")
    parser.add_argument("--run-dir", default=None, help="keep the metrics (gradhub plot it)")
    parser.add_argument("--peer", default=PEER, help="the setting the ratios are against")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    settings = [args.peer] + [s for s in args.settings.split(",") if s and s != args.peer]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        parser.error(f"unknown setting(s) {unknown}; choose from {list(SETTINGS)}")
    model = [
        *("--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps)),
        *("--batch", str(args.batch), "--seq", str(args.seq), "--device", "cpu"),
        *("--eval-every", str(max(1, args.steps // 10)), "--eval-windows", "256"),
    ]
    before = machine_note()
    with tempfile.TemporaryDirectory() as scratch:
        run_dir = args.run_dir or scratch
        report = rank_zero_result(rank_main, WORLD_SIZE, settings, model, run_dir, timeout=7200)
    after = os.getloadavg()
    rows = summarise(report, args.peer)
    best = frontier(rows)
    meta = {
        "machine": platform.platform(),
        "torch": torch.__version__,
        "world_size": WORLD_SIZE,
        "example_flags": model,
        "note": f"{WORLD_SIZE} ranks time-slice on {os.cpu_count()} cores, 1 intra-op thread "
        "each; bytes are the ring's count from each exchange's algorithm, not measured",
        "copy_bandwidth": before,
        "loadavg_after": list(after),
        "frontier": best,
    }
    text = (
        f"examples/diloco_lm.py on {WORLD_SIZE} ranks ({os.cpu_count()} cores: they "
        f"time-slice), `{' '.join(model)}`, the same samples for every setting "
        f"({rows[0]['samples']:,}); ratios against `{args.peer}`; one-thread copy "
        f"{before['copy_GBps_median']:.1f} GB/s; "
        f"load average {before['loadavg'][0]:.2f} before, {after[0]:.2f} after.\n\n"
        f"{markdown(rows)}\n\nFrontier (fewest bytes within {TOLERANCE:.0%} of allreduce's "
        f"validation loss): {best or 'none'}.\n"
    )
    write_results(args.out, "diloco", {"meta": meta, "rows": rows}, text)
    print(text)


if __name__ == "__main__":
    main()
