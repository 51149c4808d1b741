"""PNG curves of a run folder's metrics (matplotlib, an optional extra).

A run folder holds ``metrics.rank<r>.jsonl`` files (one job) or sub-folders
that do (one job each, e.g. one per strategy in ``gradhub demo``). The figure
has three panels: training loss per step (rank 0), and the loss and accuracy
on ``eval_data`` per epoch; one curve per job. Jobs that log ``"eval"``
records (``step``, ``samples``, ``bytes_sent``, ``eval_loss``: a script's own
loop, as ``examples/diloco_lm.py``) add two panels: the validation loss
against the samples seen and against the bytes each worker sent (log scale:
records with none sent yet are left out), the figure that compares
strategies by what they cost the link; the epoch panels are then left out
where no job has epochs.

Decisions: every axis takes its range from the data (log scale for a loss
only when all its values are positive); epoch axes have whole-number ticks; a
curve is broken where the step count starts again (records of two runs in one
folder, or a job restarted from a checkpoint) instead of drawing a line back;
a restart (a ``"restart"`` record) is a dotted vertical line at the step it
resumed from; a membership change of a surviving job (a ``"membership"``
record) a dashed red line at the step the survivors continued from, labelled
with the workers left; a job without evaluation accuracy (a regression) has no
accuracy curve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradhub.errors import InvalidOptionError
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


def _evals(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``"eval"`` records that hold a validation loss, samples and bytes sent."""
    keys = ("eval_loss", "samples", "bytes_sent")
    return [r for r in records if r["kind"] == "eval" and all(r.get(k) is not None for k in keys)]


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
        raise InvalidOptionError(
            f"no metrics.rank*.jsonl under {run_dir}\n"
            "- help: pass the run_dir given to fit() (or gradhub demo's run folder)"
        )
    from matplotlib.ticker import MaxNLocator

    evals = {name: _evals(ranks[min(ranks)]) for name, ranks in jobs.items()}
    by_cost = any(evals.values())
    by_epoch = not by_cost or any(
        r["kind"] == "epoch" for ranks in jobs.values() for r in ranks[min(ranks)]
    )
    count = 1 + 2 * by_epoch + 2 * by_cost
    fig, axes = plt.subplots(1, count, figsize=(5 * count, 4.2), squeeze=False)
    ax_loss, *rest = axes[0]
    ax_eval_loss, ax_acc = rest[:2] if by_epoch else (None, None)
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
        for r in (r for r in records if r["kind"] == "membership"):
            label = f"{r['world_size']} workers" if r["dead"] else f"{r['world_size']} (joined)"
            ax_loss.axvline(r["step"], ls="--", lw=0.8, color="tab:red", label=label)
        losses += [r["loss"] for r in steps]
        if by_cost:
            losses += [r["eval_loss"] for r in evals[name]]
            for ax, key in zip(rest[-2:], ("samples", "bytes_sent"), strict=True):
                kept = [r for r in evals[name] if r[key] > 0]  # a log axis for the bytes
                parts = [[(r[key], r["eval_loss"]) for r in p] for p in segments(kept, "step")]
                _draw(ax, parts, name, marker=".")
        if ax_eval_loss is None or ax_acc is None:
            continue
        for ax, key in ((ax_eval_loss, "eval_loss"), (ax_acc, "eval_accuracy")):
            kept = [r for r in epochs if r.get(key) is not None]
            parts = [[(r["epoch"] + 1, r[key]) for r in part] for part in segments(kept, "epoch")]
            _draw(ax, parts, name, marker=".")
            if key == "eval_loss":
                losses += [r[key] for r in kept]
    scale = "log" if losses and min(losses) > 0 else "linear"
    ax_loss.set(title="training loss (rank 0, per step)", xlabel="step", yscale=scale)
    if ax_eval_loss is not None and ax_acc is not None:
        ax_eval_loss.set(title="eval_data loss", xlabel="epoch", yscale=scale)
        ax_acc.set(title="eval_data accuracy", xlabel="epoch")
        for ax in (ax_eval_loss, ax_acc):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if by_cost:
        by_samples, by_bytes = rest[-2:]
        by_samples.set(title="validation loss", xlabel="samples seen", yscale=scale)
        by_bytes.set(title="validation loss", xlabel="bytes sent per worker", yscale=scale)
        by_bytes.set_xscale("log")  # strategies differ by orders of magnitude
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    output = Path(output) if output is not None else run_dir / "curves.png"
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output
