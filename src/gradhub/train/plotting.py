"""PNG curves of a run folder's metrics (matplotlib, an optional extra).

A run folder holds ``metrics.rank<r>.jsonl`` files (one job) or sub-folders
that do (one job each, e.g. one per strategy in ``gradhub demo``). The figure
has three panels: training loss per step (rank 0), and evaluation loss and
accuracy per epoch; one curve per job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradhub.train.metrics import read_metrics


def find_jobs(run_dir: Path) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Jobs under ``run_dir`` by name: the folder itself and its direct sub-folders."""
    run_dir = Path(run_dir)
    jobs = {}
    for folder in [run_dir, *sorted(p for p in run_dir.iterdir() if p.is_dir())]:
        metrics = read_metrics(folder)
        if metrics:
            jobs[folder.name if folder != run_dir else run_dir.name] = metrics
    return jobs


def plot_run(run_dir: Path, output: Path | None = None) -> Path:
    """Draw the curves of every job under ``run_dir`` into a PNG; returns its path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plots need matplotlib: pip install 'gradhub[demo]'") from exc
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run folder {run_dir} does not exist")
    jobs = find_jobs(run_dir)
    if not jobs:
        raise ValueError(
            f"no metrics.rank*.jsonl under {run_dir}\n"
            "- help: pass the run_dir given to fit() (or gradhub demo's run folder)"
        )
    fig, (ax_loss, ax_eval_loss, ax_acc) = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, ranks in jobs.items():
        records = ranks[min(ranks)]
        steps = [r for r in records if r["kind"] == "step"]
        epochs = [r for r in records if r["kind"] == "epoch"]
        if steps:
            ax_loss.plot([r["step"] for r in steps], [r["loss"] for r in steps], label=name, lw=0.8)
        with_eval = [r for r in epochs if r.get("eval_accuracy") is not None]
        if with_eval:
            x = [r["epoch"] + 1 for r in with_eval]
            ax_eval_loss.plot(x, [r["eval_loss"] for r in with_eval], marker=".", label=name)
            ax_acc.plot(x, [r["eval_accuracy"] for r in with_eval], marker=".", label=name)
    ax_loss.set(title="training loss (rank 0, per step)", xlabel="step", yscale="log")
    ax_eval_loss.set(title="test loss", xlabel="epoch", yscale="log")
    ax_acc.set(title="test accuracy", xlabel="epoch", ylim=(0.8, 1.0))
    for ax in (ax_loss, ax_eval_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    output = Path(output) if output is not None else run_dir / "curves.png"
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output
