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
SETTINGS = [
    PEER,
    "allreduce powersgd",
    *(f"diloco H={h}" for h in (10, 50, 100, 500)),
    *(f"streaming H=100 F=4 {c}" for c in ("bf16", "fp4")),
]
"""The default settings; any name :func:`flags` parses is a setting (the
records' tuned ones: ``"allreduce lr=8e-3"``, ``"diloco H=50 fp4 lr=8e-3
outer-momentum=0.8"``, ``"streaming H=100 F=4 fp4 lr=4e-3 outer-lr=1.0"``)."""
_FLAGS = {
    "H": "--inner-steps",
    "F": "--fragments",
    "lr": "--lr",
    "outer-lr": "--outer-lr",
    "outer-momentum": "--outer-momentum",
}


def flags(setting: str) -> list[str]:
    """The example's flags of a setting: its strategy (``allreduce``, ``diloco``,
    ``streaming``: diloco with fragments), then words ``KEY=VALUE`` (``H``,
    ``F``, ``lr``, ``outer-lr``, ``outer-momentum``) and a compression
    (``powersgd``; ``bf16``, ``fp4``)."""
    strategy, *words = setting.split()
    if strategy not in ("allreduce", "diloco", "streaming"):
        raise ValueError(f"{setting!r}: starts with allreduce, diloco or streaming")
    out = ["--strategy", "allreduce" if strategy == "allreduce" else "diloco"]
    for word in words:
        key, _, value = word.partition("=")
        if value and key in _FLAGS:
            out += [_FLAGS[key], value]
        elif not value and word in ("powersgd", "bf16", "fp4"):
            out += ["--compress", word]
        else:
            raise ValueError(f"{setting!r}: unknown word {word!r}")
    if (strategy == "streaming") != ("--fragments" in out):
        raise ValueError(f"{setting!r}: streaming, and only streaming, names F=")
    return out


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
            out = diloco_lm.main([*flags(name), *model, "--run-dir", folder])
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
    for setting in settings:
        try:
            flags(setting)
        except ValueError as exc:
            parser.error(str(exc))
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
