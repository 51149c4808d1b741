"""``gradhub plot``: ranges from the data, whole epochs, restarts break the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradhub.train.plotting import plot_run, segments


def test_segments_break_where_the_count_restarts() -> None:
    records = [{"step": s} for s in (1, 2, 3, 1, 2, 5)]
    assert [[r["step"] for r in part] for part in segments(records, "step")] == [
        [1, 2, 3],
        [1, 2, 5],
    ]


def test_plot_axes_follow_the_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [{"kind": "step", "step": s, "loss": 2.0 / s} for s in (1, 2, 3)]
    lines += [{"kind": "restart", "restart": 1, "step": 0}]  # resumed from no checkpoint
    lines += [{"kind": "step", "step": s, "loss": 2.0 / s} for s in (1, 2)]
    lines += [
        {"kind": "epoch", "epoch": e, "eval_loss": 1.0 / (e + 1), "eval_accuracy": 0.3 + 0.1 * e}
        for e in range(3)
    ]
    (tmp_path / "metrics.rank0.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    import matplotlib.figure

    saved: list[matplotlib.figure.Figure] = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    plot_run(tmp_path)
    loss, eval_loss, acc = saved[0].axes
    curves = [line for line in loss.lines if line.get_label() != "restart"]
    assert len(curves) == 2  # the restart is a second segment, not a line back to step 1
    marks = [line for line in loss.lines if line.get_label() == "restart"]
    assert [list(m.get_xdata()) for m in marks] == [[0, 0]]  # where it resumed from
    low, high = acc.get_ylim()
    assert low < 0.3 and 0.5 < high < 0.6  # from the data (it was fixed at 0.8-1.0)
    assert all(t == int(t) for t in acc.get_xticks())
    assert eval_loss.get_title() == "eval_data loss" and acc.get_title() == "eval_data accuracy"


def test_eval_records_add_loss_against_samples_and_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, per_step in (("allreduce", 1000.0), ("diloco", 20.0)):
        lines = [{"kind": "step", "step": s, "loss": 3.0 / s} for s in (1, 10, 20)]
        lines += [
            {
                "kind": "eval",
                "step": s,
                "samples": 8 * s,
                "bytes_sent": per_step * (s - 1),
                "eval_loss": 3.0 / s,
            }
            for s in (1, 10, 20)
        ]
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.rank0.jsonl").write_text(
            "\n".join(json.dumps(x) for x in lines)
        )
    import matplotlib.figure

    saved: list[matplotlib.figure.Figure] = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    plot_run(tmp_path)
    _, by_samples, by_bytes = saved[0].axes  # no epochs: no epoch panels
    assert by_samples.get_xlabel() == "samples seen"
    assert by_bytes.get_xlabel() == "bytes sent per worker" and by_bytes.get_xscale() == "log"
    curves = {line.get_label(): line for line in by_bytes.lines}
    assert list(curves["diloco"].get_xdata()) == [180.0, 380.0]  # none sent yet: left out
    assert list(curves["allreduce"].get_ydata()) == [0.3, 0.15]
    assert [x for (x,) in [line.get_xdata()[-1:] for line in by_samples.lines]] == [160, 160]


def test_a_membership_change_is_a_dashed_line_where_the_survivors_went_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = [{"kind": "step", "step": s, "loss": 2.0 / s} for s in range(1, 9)]
    lines.insert(5, {"kind": "membership", "step": 5, "world_size": 3, "dead": [2]})
    lines.insert(7, {"kind": "membership", "step": 6, "world_size": 4, "dead": []})
    (tmp_path / "metrics.rank0.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    import matplotlib.figure

    saved: list[matplotlib.figure.Figure] = []
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig))
    plot_run(tmp_path)
    loss = saved[0].axes[0]
    marks = {m.get_label(): list(m.get_xdata()) for m in loss.lines if m.get_linestyle() == "--"}
    assert marks == {"3 workers": [5, 5], "4 (joined)": [6, 6]}
