"""PNG curves of a run folder's metrics (matplotlib, an optional extra).

A run folder holds ``metrics.rank<r>.jsonl`` files (one job) or sub-folders
that do (one job each, e.g. one per strategy in ``gradhub demo``). The figure
has three panels: training loss per step (rank 0), and the loss and accuracy
on ``eval_data`` per epoch; one curve per job.

Decisions: every axis takes its range from the data (log scale for a loss
only when all its values are positive); epoch axes have whole-number ticks; a
curve is broken where the step count starts again (records of two runs in one
folder, or a job restarted from a checkpoint) instead of drawing a line back;
a restart (a ``"restart"`` record) is a dotted vertical line at the step it
resumed from; a job without evaluation accuracy (a regression) has no
accuracy curve.
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


def segments(records: list[dict[str, Any]], key: str) -> list[list[dict[str, Any]]]:
    """``records`` cut wherever ``key`` does not increase (a restarted run)."""
    out: list[list[dict[str, Any]]] = []
    for r in records:
        if not out or r[key] <= out[-1][-1][key]:
            out.append([])
        out[-1].append(r)
    return out


def _draw(ax: Any, parts: list[list[tuple[float, float]]], name: str, **style: Any) -> None:
    color = None
    for i, part in enumerate(parts):
        (line,) = ax.plot(
            [p[0] for p in part],
            [p[1] for p in part],
            label=name if i == 0 else None,
            color=color,
            **style,
        )
        color = line.get_color()


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
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_eval_loss, ax_acc) = plt.subplots(1, 3, figsize=(15, 4.2))
    losses: list[float] = []
    restarted = False
    for name, ranks in jobs.items():
        records = ranks[min(ranks)]
        steps = [r for r in records if r["kind"] == "step" and r.get("loss") is not None]
        epochs = [r for r in records if r["kind"] == "epoch"]
        step_parts = [[(r["step"], r["loss"]) for r in part] for part in segments(steps, "step")]
        _draw(ax_loss, step_parts, name, lw=0.8)
        for i, r in enumerate(r for r in records if r["kind"] == "restart"):
            label = "restart" if i == 0 and not restarted else None
            ax_loss.axvline(r["step"], ls=":", lw=1.0, color="0.4", label=label)
            restarted = True
        losses += [r["loss"] for r in steps]
        for ax, key in ((ax_eval_loss, "eval_loss"), (ax_acc, "eval_accuracy")):
            kept = [r for r in epochs if r.get(key) is not None]
            parts = [[(r["epoch"] + 1, r[key]) for r in part] for part in segments(kept, "epoch")]
            _draw(ax, parts, name, marker=".")
            if key == "eval_loss":
                losses += [r[key] for r in kept]
    scale = "log" if losses and min(losses) > 0 else "linear"
    ax_loss.set(title="training loss (rank 0, per step)", xlabel="step", yscale=scale)
    ax_eval_loss.set(title="eval_data loss", xlabel="epoch", yscale=scale)
    ax_acc.set(title="eval_data accuracy", xlabel="epoch")
    for ax in (ax_eval_loss, ax_acc):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_loss, ax_eval_loss, ax_acc):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    output = Path(output) if output is not None else run_dir / "curves.png"
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output
