"""``gradhub run --survive``: what it costs per step, and how soon a kill is behind.

Both parts launch :mod:`_survive_job` (an MLP 512-1024-1024-10, 1.58M
parameters, SGD with momentum, synthetic data, global batches of 512,
``DataParallelTrainer.fit`` with ``strategy="allreduce"``) through the CLI,
as a user does, one job after another:

1. **Per-step cost.** ``gradhub run -n 2 _survive_job.py`` (plain: torchrun's
   agent starts the workers) and ``gradhub run -n 2 --survive
   _survive_job.py`` (the launcher's supervisor starts them and hosts the
   store), ``--steps`` steps each, alternating (plain, survive / survive,
   plain / ...) for ``--rounds`` rounds. A run's step time is rank 0's own
   measurement of its training loop: the median of the differences between
   the ``perf_counter`` times at which consecutive steps committed (fit's
   ``on_step``, where it writes its step record), the first 10 steps skipped;
   ``FitResult.wall_time / steps`` beside it. Reported: the median and
   min-max over the rounds of each, the ratio of the medians survive / plain
   and the median [min, max] of the per-round ratios. Twice: with the
   environment as it is (``OMP_NUM_THREADS`` removed: torchrun's agent then
   sets 1 for each worker, the supervisor sets nothing, and torch takes
   every core), and with ``OMP_NUM_THREADS=1`` for both (the survival
   machinery alone); the torch threads each job ran with are recorded.
2. **A kill to the next committed step.** ``--kill-jobs`` jobs of ``gradhub
   run -n 4 --survive _survive_job.py --bucket-mb 1`` (several buckets, so
   all-reduces are under way in the backward), 60 steps, each killing two
   workers: one from a gradient hook in the middle of a step's backward, one
   between two steps (after a step committed), 20 steps apart, different
   workers (rank 0 among them) from job to job. The dying worker writes the
   wall-clock time and its committed step count just before
   ``os.kill(SIGKILL)``; the figure is the time from there to the wall-clock
   time at which the last survivor committed the first step past that count
   (steps already in flight on a slower survivor do not count). Per kill,
   the steps trained again: the most, over the survivors, of the extra
   trainings (a forward hook notes the committed count at every forward) of
   the steps from the dying worker's count up to the next kill's. Reported:
   each kill, and the median [min, max] over all of them. Every job must
   exit 0 with two survivors at the fault-free step count.

4 workers on 2 cores time-slice: part 2's times include that. Records the
machine's one-thread copy bandwidth, the load average before each part and
after the last, and the scheduling policy the jobs ran under (they inherit
it: ``chrt -f 10`` keeps other work on a shared machine from preempting
them; the job processes only block in the kernel, they never spin). Writes
``survive.json`` and ``survive.md`` to ``--out``.

    chrt -f 10 .venv/bin/python benchmarks/survive.py [--rounds 5] [--steps 150] [--kill-jobs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from _common import RESULTS, machine_note, spread, write_results

JOB = Path(__file__).with_name("_survive_job.py")
SKIP = 10
"""Steps at the start of a run left out of its step time (warm-up)."""
THREADS = {"as launched": None, "OMP_NUM_THREADS=1": "1"}
"""The workers' environment: OMP_NUM_THREADS removed, or set to this."""
KILL_STEPS = 60
KILL_PLANS = [  # (member, step, where) twice per job: rank 0 among the dead
    [(1, 20, "backward"), (2, 40, "between")],
    [(0, 20, "between"), (3, 40, "backward")],
    [(2, 20, "backward"), (0, 40, "between")],
    [(3, 20, "between"), (1, 40, "backward")],
    [(0, 20, "backward"), (2, 40, "between")],
]


def launch(
    out: Path, workers: int, survive: bool, job: list[str], threads: str | None = "1"
) -> None:
    """``gradhub run -n workers [--survive] _survive_job.py --out out *job``; raises
    with the job's output if it does not exit 0."""
    cmd = [sys.executable, "-m", "gradhub.cli.main", "run", "-n", str(workers)]
    cmd += ["--survive"] if survive else []
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    done = subprocess.run(
        [*cmd, str(JOB), "--out", str(out), *job],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}")


def members(out: Path) -> dict[int, dict[str, Any]]:
    """The reports of the workers that finished, by member id."""
    found = {}
    for path in out.glob("member-*.json"):
        report = json.loads(path.read_text())
        found[report["member"]] = report
    return found


def step_time(out: Path) -> dict[str, float]:
    """Rank 0's step time: the median step-to-step time, and wall_time / steps."""
    rank0 = members(out)[0]
    clock = rank0["step_clock"]
    diffs = [b - a for a, b in zip(clock[SKIP:], clock[SKIP + 1 :], strict=False)]
    result = rank0["result"]
    return {
        "step_s": statistics.median(diffs),
        "wall_per_step_s": result["wall_time"] / result["steps"],
        "threads": rank0["threads"],
    }


def overhead(rounds: int, steps: int, scratch: Path) -> dict[str, Any]:
    """Part 1: plain and --survive alternating, per thread setting."""
    job = ["--steps", str(steps)]
    found: dict[str, Any] = {}
    for name, threads in THREADS.items():
        runs: dict[str, list[dict[str, float]]] = {"plain": [], "survive": []}
        for r in range(rounds):
            order = ["plain", "survive"] if r % 2 == 0 else ["survive", "plain"]
            for mode in order:
                out = scratch / f"{name}-{mode}-{r}".replace("=", "")
                launch(out, 2, mode == "survive", job, threads)
                runs[mode].append(step_time(out))
        pairs = zip(runs["plain"], runs["survive"], strict=True)
        ratios = [s["step_s"] / p["step_s"] for p, s in pairs]
        found[name] = {
            "runs": runs,
            "threads": {m: sorted({int(x["threads"]) for x in v}) for m, v in runs.items()},
            **{
                f"{m}_{key}": spread([x[key] for x in v])
                for m, v in runs.items()
                for key in ("step_s", "wall_per_step_s")
            },
            "ratio_per_round": spread(ratios),
        }
        f = found[name]
        f["ratio_of_medians"] = f["survive_step_s"]["median"] / f["plain_step_s"]["median"]
    return found


def kill_job(index: int, plan: list[tuple[int, int, str]], scratch: Path) -> list[dict[str, Any]]:
    """One job of part 2: its kills, each timed to the next committed step."""
    out = scratch / f"kills-{index}"
    job = ["--steps", str(KILL_STEPS), "--bucket-mb", "1"]
    for member, step, where in plan:
        job += ["--kill", f"{member}:{step}:{where}"]
    launch(out, 4, True, job)
    survivors = members(out)
    dead = {m for m, _, _ in plan}
    assert sorted(survivors) == sorted(set(range(4)) - dead), sorted(survivors)
    for report in survivors.values():
        assert report["result"]["steps"] == KILL_STEPS, report["result"]
    kills = []
    for member, step, where in plan:
        killed = json.loads((out / f"killed-{member}.json").read_text())
        kills.append({"job": index, "member": member, "step": step, "where": where, **killed})
    kills.sort(key=lambda k: k["time"])
    for k, following in zip(kills, [*kills[1:], None], strict=True):
        end = following["committed"] if following is not None else KILL_STEPS
        nexts, again = [], []
        for report in survivors.values():
            records = zip(report["steps"], report["step_wall"], strict=True)
            nexts.append(next(w for s, w in records if s > k["committed"]) - k["time"])
            tries = Counter(report["forwards"])
            again.append(sum(n - 1 for s, n in tries.items() if k["committed"] <= s < end))
        k["to_next_commit_s"] = max(nexts)
        k["to_next_commit_first_survivor_s"] = min(nexts)
        k["steps_trained_again"] = max(again)
    return kills


def recovery(jobs: int, scratch: Path) -> dict[str, Any]:
    """Part 2: ``jobs`` jobs of 4 workers, two kills each."""
    kills = []
    for i in range(jobs):
        kills += kill_job(i, KILL_PLANS[i % len(KILL_PLANS)], scratch)
    return {
        "kills": kills,
        "to_next_commit_s": spread([k["to_next_commit_s"] for k in kills]),
        "steps_trained_again": spread([float(k["steps_trained_again"]) for k in kills]),
    }


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    copy = meta["machine"]
    loads = meta["loadavg"]
    lines = [
        f"`gradhub run --survive` against the same job without it ({meta['model']}, global "
        f'batch {meta["batch"]}, `strategy="allreduce"`); one-thread copy '
        f"{copy['copy_GBps_median']:.1f} GB/s; load average (1 min) "
        f"{loads['overhead'][0]:.1f} before part 1, {loads['kills'][0]:.1f} before part 2, "
        f"{loads['after'][0]:.1f} after (the jobs' own workers included); scheduling: "
        f"{meta['scheduling']}.",
        "",
        f"Per-step cost, `gradhub run -n 2 [--survive]`, {meta['rounds']} alternating rounds of "
        f"{meta['steps']} steps (rank 0's median step-to-step time, the first {SKIP} skipped; "
        "median [min, max] over the rounds):",
        "",
        "| workers' environment | torch threads plain / survive | plain step (ms) "
        "| survive step (ms) | survive / plain (medians) | survive / plain, per round "
        "| wall_time / steps, plain / survive (ms) |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: |",
    ]

    def ms(s: dict[str, float]) -> str:
        return f"{s['median'] * 1e3:.1f} [{s['min'] * 1e3:.1f}, {s['max'] * 1e3:.1f}]"

    for name, row in report["overhead"].items():
        r = row["ratio_per_round"]
        counts = " / ".join(",".join(map(str, row["threads"][m])) for m in ("plain", "survive"))
        lines.append(
            f"| {name} | {counts} | {ms(row['plain_step_s'])} | {ms(row['survive_step_s'])} "
            f"| {row['ratio_of_medians']:.3f}x | {r['median']:.3f}x [{r['min']:.3f}, "
            f"{r['max']:.3f}] | {row['plain_wall_per_step_s']['median'] * 1e3:.1f} / "
            f"{row['survive_wall_per_step_s']['median'] * 1e3:.1f} |"
        )
    threads = {
        m: ", ".join(map(str, t)) for m, t in report["overhead"]["as launched"]["threads"].items()
    }
    if threads["plain"] != threads["survive"]:
        lines += [
            "",
            f"As launched, the workers' torch threads differ ({threads['plain']} plain, "
            f"{threads['survive']} under `--survive`): torchrun's agent sets OMP_NUM_THREADS=1 "
            "for more than one worker per node, the `--survive` supervisor leaves it unset. "
            "The OMP_NUM_THREADS=1 row compares the survival machinery alone.",
        ]
    rec = report["kills"]
    t, again = rec["to_next_commit_s"], rec["steps_trained_again"]
    lines += [
        "",
        f"A kill to the next committed step, {len(rec['kills'])} kills in "
        f"{meta['kill_jobs']} jobs of `gradhub run -n 4 --survive` ({KILL_STEPS} steps, "
        "1 MB buckets; 4 workers on "
        f"{meta['cores']} cores): median {t['median']:.3f} s [{t['min']:.3f}, {t['max']:.3f}] "
        f"until every survivor committed it; steps trained again per kill: median "
        f"{again['median']:.0f} [{again['min']:.0f}, {again['max']:.0f}].",
        "",
        "| job | worker killed | where (steps from 0) | kill to next commit, last survivor (s) "
        "| first survivor (s) | steps trained again |",
        "| ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for k in rec["kills"]:
        where = f"{k['where']} of step" if k["where"] == "backward" else "after step"
        lines.append(
            f"| {k['job']} | {k['member']} | {where} {k['step']} "
            f"| {k['to_next_commit_s']:.3f} | {k['to_next_commit_first_survivor_s']:.3f} "
            f"| {k['steps_trained_again']} |"
        )
    return "\n".join(lines) + "\n"


def scheduling() -> str:
    policy = os.sched_getscheduler(0)
    names = {os.SCHED_OTHER: "SCHED_OTHER", os.SCHED_FIFO: "SCHED_FIFO", os.SCHED_RR: "SCHED_RR"}
    priority = os.sched_getparam(0).sched_priority
    return f"{names.get(policy, str(policy))}" + (f" priority {priority}" if priority else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150, help="steps per run of part 1")
    parser.add_argument("--kill-jobs", type=int, default=5, help="jobs of part 2 (2 kills each)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    machine = machine_note()
    with tempfile.TemporaryDirectory(prefix="survive-bench-") as folder:
        scratch = Path(folder)
        loads = {"overhead": list(os.getloadavg())}
        started = time.perf_counter()
        cost = overhead(args.rounds, args.steps, scratch)
        loads["kills"] = list(os.getloadavg())
        kills = recovery(args.kill_jobs, scratch)
        loads["after"] = list(os.getloadavg())
    report = {
        "meta": {
            "platform": platform.platform(),
            "torch": torch.__version__,
            "cores": os.cpu_count(),
            "model": "MLP 512-1024-1024-10, 1.58M parameters",
            "batch": 512,
            "rounds": args.rounds,
            "steps": args.steps,
            "kill_jobs": args.kill_jobs,
            "scheduling": scheduling(),
            "machine": machine,
            "loadavg": loads,
            "seconds": time.perf_counter() - started,
        },
        "overhead": cost,
        "kills": kills,
    }
    text = markdown(report)
    write_results(args.out, "survive", report, text)
    print(text)


if __name__ == "__main__":
    main()
