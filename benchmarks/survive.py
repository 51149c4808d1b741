"""``gradhub run --survive``: what it costs per step, and how soon a kill is behind.

Both parts launch :mod:`_survive_job` (an MLP 512-1024-1024-10, 1.59M
parameters, SGD with momentum, synthetic data, global batches of 512,
``DataParallelTrainer.fit``) through the CLI, as a user does, one job after
another, for each ``--strategy`` (``allreduce`` and ``sharded``, by default
both: both parts for one, then both for the other, into one table):

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
   Under ``sharded`` a surviving rank also holds a mirror of another rank's
   slice (fp32 weights and optimizer state) and steps it at every step:
   reported are the mirror's bytes (computed from the model's size and the
   world size, and measured from rank 0's mirror as its job ends) and rank
   0's median times of its own slice's optimizer step and of the mirror's,
   timed in the job around each call. ``sharded`` without ``--survive``
   steps its slice during the backward (``step_ahead``); a surviving job
   does not (a failed step must change nothing): the ratio includes that.
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
   each kill, and the median [min, max] over all of them (under ``sharded``
   a step that some survivors applied is finished on the others, not
   trained again). Every job must exit 0 with two survivors at the
   fault-free step count.

4 workers on 2 cores time-slice: part 2's times include that. Records the
machine's one-thread copy bandwidth, the load average before each part and
after the last, and the scheduling policy the jobs ran under (they inherit
it: ``chrt -f 10`` keeps other work on a shared machine from preempting
them; the job processes only block in the kernel, they never spin). Writes
``survive.json`` and ``survive.md`` to ``--out``; what stands in the old
``survive.md`` from a line ``## Earlier records`` on is kept below the new
table.

    chrt -f 10 .venv/bin/python benchmarks/survive.py [--rounds 5] [--steps 150] [--kill-jobs 5]
        [--strategy allreduce|sharded|both] [--threads both|as-launched|one]
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
from _survive_table import markdown

JOB = Path(__file__).with_name("_survive_job.py")
SKIP = 10
"""Steps at the start of a run left out of its step time (warm-up)."""
THREADS = {"as launched": None, "OMP_NUM_THREADS=1": "1"}
"""The workers' environment: OMP_NUM_THREADS removed, or set to this."""
THREAD_CHOICES = {
    "both": list(THREADS),
    "as-launched": ["as launched"],
    "one": ["OMP_NUM_THREADS=1"],
}
STRATEGIES = ["allreduce", "sharded"]
WORLD = 2
"""Workers of part 1."""
PARAMETERS = 512 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
STATE_PER_ELEMENT = 1
"""Optimizer state tensors per parameter element: SGD's momentum buffer."""
EARLIER = "## Earlier records"
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


def step_time(out: Path) -> dict[str, Any]:
    """Rank 0's step time: the median step-to-step time, and wall_time / steps;
    under ``sharded`` the median times of its slice's and its mirror's optimizer
    steps (``None`` where none ran) and its mirrors' bytes."""
    rank0 = members(out)[0]
    clock = rank0["step_clock"]
    diffs = [b - a for a, b in zip(clock[SKIP:], clock[SKIP + 1 :], strict=False)]
    result = rank0["result"]
    found: dict[str, Any] = {
        "step_s": statistics.median(diffs),
        "wall_per_step_s": result["wall_time"] / result["steps"],
        "threads": rank0["threads"],
    }
    for key in ("own_step_s", "mirror_step_s"):
        timed = rank0.get(key, [])[SKIP:]
        found[key] = statistics.median(timed) if timed else None
    found["mirrors"] = rank0.get("mirrors", [])
    return found


def overhead(
    strategy: str, rounds: int, steps: int, threads: list[str], scratch: Path
) -> dict[str, Any]:
    """Part 1: plain and --survive alternating, per thread setting."""
    job = ["--steps", str(steps), "--strategy", strategy]
    found: dict[str, Any] = {}
    for name in threads:
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "survive": []}
        for r in range(rounds):
            order = ["plain", "survive"] if r % 2 == 0 else ["survive", "plain"]
            for mode in order:
                out = scratch / f"{strategy}-{name}-{mode}-{r}".replace("=", "")
                launch(out, WORLD, mode == "survive", job, THREADS[name])
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
        for key in ("own_step_s", "mirror_step_s"):
            timed = [x[key] for x in runs["survive"] if x[key] is not None]
            f[f"survive_{key}"] = spread(timed) if timed else None
    return found


def mirror_bytes(cost: dict[str, Any]) -> dict[str, Any]:
    """What a rank's mirror holds: computed from the model and world size, and as
    measured on rank 0 in part 1's surviving runs (their median)."""
    length = -(-PARAMETERS // WORLD)  # the largest slice
    measured = [
        sum(m["weights"] + m["state"] for m in run["mirrors"])
        for row in cost.values()
        for run in row["runs"]["survive"]
    ]
    weights = [
        sum(m["weights"] for m in run["mirrors"])
        for r in cost.values()
        for run in r["runs"]["survive"]
    ]
    return {
        "computed_bytes": 4 * length * (1 + STATE_PER_ELEMENT),
        "computed_weight_bytes": 4 * length,
        "measured_bytes": statistics.median(measured) if measured else None,
        "measured_weight_bytes": statistics.median(weights) if weights else None,
        "model_fp32_bytes": 4 * PARAMETERS,
    }


def kill_job(
    strategy: str, index: int, plan: list[tuple[int, int, str]], scratch: Path
) -> list[dict[str, Any]]:
    """One job of part 2: its kills, each timed to the next committed step."""
    out = scratch / f"{strategy}-kills-{index}"
    job = ["--steps", str(KILL_STEPS), "--bucket-mb", "1", "--strategy", strategy]
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


def recovery(strategy: str, jobs: int, scratch: Path) -> dict[str, Any]:
    """Part 2: ``jobs`` jobs of 4 workers, two kills each."""
    kills = []
    for i in range(jobs):
        kills += kill_job(strategy, i, KILL_PLANS[i % len(KILL_PLANS)], scratch)
    return {
        "kills": kills,
        "to_next_commit_s": spread([k["to_next_commit_s"] for k in kills]),
        "steps_trained_again": spread([float(k["steps_trained_again"]) for k in kills]),
    }


def scheduling() -> str:
    policy = os.sched_getscheduler(0)
    names = {os.SCHED_OTHER: "SCHED_OTHER", os.SCHED_FIFO: "SCHED_FIFO", os.SCHED_RR: "SCHED_RR"}
    priority = os.sched_getparam(0).sched_priority
    return f"{names.get(policy, str(policy))}" + (f" priority {priority}" if priority else "")


def earlier(out: str | Path) -> str:
    """What the last ``survive.md`` in ``out`` keeps from its ``## Earlier records`` line on."""
    path = Path(out) / "survive.md"
    text = path.read_text() if path.exists() else ""
    return text[text.index(EARLIER) :] if EARLIER in text else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=150, help="steps per run of part 1")
    parser.add_argument("--kill-jobs", type=int, default=5, help="jobs of part 2 (2 kills each)")
    parser.add_argument("--strategy", choices=[*STRATEGIES, "both"], default="both")
    parser.add_argument(
        "--threads", choices=list(THREAD_CHOICES), default="both", help="part 1's environments"
    )
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    strategies = STRATEGIES if args.strategy == "both" else [args.strategy]
    machine = machine_note()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    recorded = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()) + f" at {head.stdout.strip()}"
    found: dict[str, Any] = {}
    loads: dict[str, Any] = {}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="survive-bench-") as folder:
        scratch = Path(folder)
        for strategy in strategies:
            loads[strategy] = {"overhead": list(os.getloadavg())}
            cost = overhead(
                strategy, args.rounds, args.steps, THREAD_CHOICES[args.threads], scratch
            )
            found[strategy] = {"overhead": cost}
            if strategy == "sharded":
                found[strategy]["mirrors"] = mirror_bytes(cost)
            loads[strategy]["kills"] = list(os.getloadavg())
            found[strategy]["kills"] = recovery(strategy, args.kill_jobs, scratch)
        loads["after"] = list(os.getloadavg())
    report = {
        "meta": {
            "recorded": recorded,
            "platform": platform.platform(),
            "torch": torch.__version__,
            "cores": os.cpu_count(),
            "model": f"MLP 512-1024-1024-10, {PARAMETERS:,} parameters",
            "batch": 512,
            "rounds": args.rounds,
            "steps": args.steps,
            "kill_jobs": args.kill_jobs,
            "world": WORLD,
            "skip": SKIP,
            "kill_steps": KILL_STEPS,
            "scheduling": scheduling(),
            "machine": machine,
            "loadavg": loads,
            "seconds": time.perf_counter() - started,
        },
        "strategies": found,
    }
    text = markdown(report)
    kept = earlier(args.out)
    write_results(args.out, "survive", report, text + ("\n" + kept if kept else ""))
    print(text)


if __name__ == "__main__":
    main()
