"""The tables of :mod:`survive` (``survive.md``), from its report (``survive.json``)."""

from __future__ import annotations

from typing import Any


def ms(s: dict[str, float]) -> str:
    return f"{s['median'] * 1e3:.1f} [{s['min'] * 1e3:.1f}, {s['max'] * 1e3:.1f}]"


def times(s: dict[str, float]) -> str:
    return f"{s['median']:.3f}x [{s['min']:.3f}, {s['max']:.3f}]"


def overhead_lines(report: dict[str, Any]) -> list[str]:
    """Part 1's table."""
    meta = report["meta"]
    lines = [
        f"Per-step cost, `gradhub run -n {meta['world']} [--survive]`, {meta['rounds']} "
        f"alternating rounds of {meta['steps']} steps (rank 0's median step-to-step time, the "
        f"first {meta['skip']} skipped; median [min, max] over the rounds):",
        "",
        "| strategy | workers' environment | torch threads plain / survive | plain step (ms) "
        "| survive step (ms) | survive / plain (medians) | survive / plain, per round "
        "| wall_time / steps, plain / survive (ms) |",
        "| --- | --- | --- | ---: | ---: | ---: | --- | ---: |",
    ]
    differ = False
    for strategy, part in report["strategies"].items():
        for name, row in part["overhead"].items():
            counts = {m: ",".join(map(str, row["threads"][m])) for m in ("plain", "survive")}
            differ = differ or counts["plain"] != counts["survive"]
            lines.append(
                f"| {strategy} | {name} | {counts['plain']} / {counts['survive']} "
                f"| {ms(row['plain_step_s'])} | {ms(row['survive_step_s'])} "
                f"| {row['ratio_of_medians']:.3f}x | {times(row['ratio_per_round'])} "
                f"| {row['plain_wall_per_step_s']['median'] * 1e3:.1f} / "
                f"{row['survive_wall_per_step_s']['median'] * 1e3:.1f} |"
            )
    if differ:
        lines += [
            "",
            "As launched, the workers' torch threads differ: torchrun's agent sets "
            "OMP_NUM_THREADS=1 for more than one worker per node, the `--survive` supervisor "
            "leaves it unset. The OMP_NUM_THREADS=1 rows compare the survival machinery alone.",
        ]
    return lines


def mirror_lines(part: dict[str, Any], world: int) -> list[str]:
    """Under ``sharded``: what the mirrors cost per rank."""
    held = part["mirrors"]
    length = held["computed_weight_bytes"] // 4
    measured = held["measured_bytes"]
    lines = [
        "",
        f"`sharded --survive`: each rank holds one more slice (a mirror of another rank's) "
        f"of fp32 weights and SGD momentum: 4 B x {length:,} elements (1.59M parameters / "
        f"{world} ranks) x 2 = {held['computed_bytes'] / 1e6:.2f} MB per rank (the whole "
        f"model's fp32 weights are {held['model_fp32_bytes'] / 1e6:.2f} MB)"
        + (
            f"; measured on rank 0: {measured / 1e6:.2f} MB "
            f"({held['measured_weight_bytes'] / 1e6:.2f} MB of it weights)."
            if measured is not None
            else "."
        ),
        "Its optimizer step runs at every step beside the rank's own slice's (rank 0, "
        "each call timed in the job, median per run; median [min, max] over the rounds; "
        "plain `sharded` steps its slice during the backward and is not timed):",
        "",
        "| workers' environment | own slice's optimizer step (ms) | mirror's optimizer step (ms) "
        "| mirror / survive step |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, row in part["overhead"].items():
        own, mirror = row["survive_own_step_s"], row["survive_mirror_step_s"]
        if own is None or mirror is None:
            continue
        share = mirror["median"] / row["survive_step_s"]["median"]
        lines.append(f"| {name} | {ms(own)} | {ms(mirror)} | {share:.1%} |")
    return lines


def kill_lines(report: dict[str, Any]) -> list[str]:
    """Part 2's table."""
    meta = report["meta"]
    lines = [
        "",
        f"A kill to the next committed step, {meta['kill_jobs']} jobs of `gradhub run -n 4 "
        f"--survive` per strategy ({meta['kill_steps']} steps, 1 MB buckets, two kills each; 4 "
        f"workers on {meta['cores']} cores), until every survivor committed it:",
        "",
    ]
    for strategy, part in report["strategies"].items():
        rec = part["kills"]
        t, again = rec["to_next_commit_s"], rec["steps_trained_again"]
        lines.append(
            f"- {strategy}: median {t['median']:.3f} s [{t['min']:.3f}, {t['max']:.3f}] over "
            f"{len(rec['kills'])} kills; steps trained again per kill: median "
            f"{again['median']:.0f} [{again['min']:.0f}, {again['max']:.0f}]."
        )
    lines += [
        "",
        "| strategy | job | worker killed | where (steps from 0) | kill to next commit, last "
        "survivor (s) | first survivor (s) | steps trained again |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for strategy, part in report["strategies"].items():
        for k in part["kills"]["kills"]:
            where = f"{k['where']} of step" if k["where"] == "backward" else "after step"
            lines.append(
                f"| {strategy} | {k['job']} | {k['member']} | {where} {k['step']} "
                f"| {k['to_next_commit_s']:.3f} | {k['to_next_commit_first_survivor_s']:.3f} "
                f"| {k['steps_trained_again']} |"
            )
    return lines


def markdown(report: dict[str, Any]) -> str:
    """``survive.md`` from the report ``survive.json`` holds."""
    meta = report["meta"]
    copy = meta["machine"]
    loads = meta["loadavg"]
    before = "; ".join(
        f"{s} part 1 {loads[s]['overhead'][0]:.1f}, part 2 {loads[s]['kills'][0]:.1f}"
        for s in report["strategies"]
    )
    names = " then ".join(f"`{s}`" for s in report["strategies"])
    lines = [
        f"Recorded {meta['recorded']}: "
        f"`gradhub run --survive` against the same job without it ({meta['model']}, global "
        f"batch {meta['batch']}; {names}); one-thread copy "
        f"{copy['copy_GBps_median']:.1f} GB/s; load average (1 min) before {before}; "
        f"{loads['after'][0]:.1f} after (the jobs' own workers included); scheduling: "
        f"{meta['scheduling']}; {meta['seconds'] / 60:.0f} minutes in all.",
        "",
        *overhead_lines(report),
    ]
    if "sharded" in report["strategies"]:
        lines += mirror_lines(report["strategies"]["sharded"], meta["world"])
    lines += kill_lines(report)
    return "\n".join(lines) + "\n"
