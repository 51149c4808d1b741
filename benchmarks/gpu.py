"""One GPU: plain training, DDP, and ``gradhub.prepare`` with ``allreduce`` and ``sharded``.

A world of one on the default group (``"cpu:gloo,cuda:nccl"``; NCCL refuses
two ranks on one GPU), so what is measured is each path's own cost on the
device and on the host: what a step adds to plain training before any byte
travels. Models (``--models``):

- ``MLP b64`` / ``MLP b4096``: the MLP 1024-4096-4096-10 (21M parameters) at
  batch 64 (the host's overhead shows) and 4096 (the GPU's work dominates),
  fp32, SGD with momentum;
- ``GPT-2 small``: the 124M-parameter GPT-2 (12 layers, 12 heads, 768 wide,
  1024 positions, 50257 tokens, tied embeddings), built from its config in
  plain torch (nothing downloaded), bf16 autocast, fused AdamW, batch 8 x 1024
  random tokens.

Contenders: ``plain`` (the model and optimizer alone), ``DDP``
(``DistributedDataParallel`` on the same group), ``prepare + allreduce`` and
``prepare + sharded`` (the user's own loop on what :func:`gradhub.prepare`
returns). In each round every contender runs ``--steps`` steps, the order
rotating round by round (A, B, C, D / B, C, D, A / ...); a step is timed from
before ``zero_grad`` to after ``optimizer.step()`` plus a device
synchronisation. Reports the median step over all timed steps, the min-max of
the per-round medians, the ratio to plain, and the median over rounds of the
round's ratio to plain (robust to load that changes between rounds). One more
step of each contender runs under ``torch.profiler`` (CPU and CUDA
activities): per step, host synchronisations (``cudaStreamSynchronize``,
``cudaDeviceSynchronize``, ``cudaEventSynchronize``) and ``cudaMemcpyAsync``
calls, as the CUDA runtime saw them on any thread, and reads of a device
scalar (``aten::_local_scalar_dense``: ``item()``, ``float()``, ``tolist()``)
among the operators the profiler recorded. A contender that fails is reported with its error,
not timed. Writes ``gpu.json`` and ``gpu.md`` to ``--out``.

    python benchmarks/gpu.py [--rounds 5] [--steps 4] [--models "MLP b64,GPT-2 small"]

Needs CUDA: without it, it says so and exits with status 2.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from _common import RESULTS, write_results

PLAIN = "plain"
CONTENDERS = [PLAIN, "DDP", "prepare + allreduce", "prepare + sharded"]
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
Step = Callable[[], None]


# ------------------------------------------------------------------------ models
def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)
    )


class Block(nn.Module):
    """GPT-2's block: pre-norm attention and MLP, GELU (tanh), biases."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.c_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2 small from its config: 12 x 12 x 768, 1024 positions, 50257 tokens."""

    def __init__(self, layers: int = 12, heads: int = 12, width: int = 768) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(50257, width), nn.Embedding(1024, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, 50257, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2's
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def workload(name: str, device: torch.device) -> dict[str, Any]:
    """The model maker, optimizer maker, loss and batch of model ``name``."""
    g = torch.Generator(device=device).manual_seed(0)
    if name.startswith("MLP"):
        n = int(name.split("b")[-1])
        x = torch.randn(n, 1024, device=device, generator=g)
        y = torch.randint(0, 10, (n,), device=device, generator=g)
        return {
            "make": mlp,
            "optimizer": lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
            "loss": lambda m: F.cross_entropy(m(x), y),
            "autocast": False,
        }
    tokens = torch.randint(0, 50257, (8, 1025), device=device, generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    return {
        "make": GPT2,
        "optimizer": lambda m: torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True),
        "loss": lambda m: F.cross_entropy(m(x).flatten(0, 1).float(), y.flatten()),
        "autocast": True,
    }


MODELS = ["MLP b64", "MLP b4096", "GPT-2 small"]


# ---------------------------------------------------------------------- contenders
def contender(name: str, work: dict[str, Any], runtime: Any, device: torch.device) -> Any:
    """``(step, closer)`` of contender ``name`` on a fresh copy of the model."""
    import gradhub

    model = work["make"]().to(device)
    opt: Any = work["optimizer"](model)
    run: Any = model
    close: Callable[[], None] = lambda: None  # noqa: E731
    if name == "DDP":
        run = nn.parallel.DistributedDataParallel(model)
    elif name.startswith("prepare"):
        strategy = name.split(" + ")[1]
        run, opt = gradhub.prepare(model, opt, strategy=strategy, runtime=runtime)
        close = run.close
    autocast = work["autocast"]
    loss_of = work["loss"]

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(run)
        loss.backward()
        opt.step()

    return step, close


def profiled(step: Step) -> dict[str, int]:
    """Host synchronisations, scalar reads and cudaMemcpyAsync calls of one step."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=activities) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    counts = {s: names.count(s) for s in SYNCS}
    # the synchronize() that closes the profiled step is the harness's, not the step's
    counts["cudaDeviceSynchronize"] = max(0, counts["cudaDeviceSynchronize"] - 1)
    return {
        "host_syncs": sum(counts.values()),
        **counts,
        "item": names.count("aten::_local_scalar_dense"),
        "cudaMemcpyAsync": names.count("cudaMemcpyAsync"),
    }


def measure(model: str, methods: list[str], rounds: int, steps: int, runtime: Any) -> list[Any]:
    device = runtime.device
    work = workload(model, device)
    made: dict[str, tuple[Step, Callable[[], None]]] = {}
    errors: dict[str, str] = {}
    for name in methods:
        try:
            made[name] = contender(name, work, runtime, device)
            for _ in range(3):  # warm-up: allocations, buckets, kernels' autotuning
                made[name][0]()
            torch.cuda.synchronize()
        except Exception as exc:  # a failing contender is reported, not timed
            errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            made.pop(name, None)
    live = [m for m in methods if m in made]
    times: dict[str, list[list[float]]] = {m: [] for m in live}
    for r in range(rounds):
        order = live[r % len(live) :] + live[: r % len(live)] if live else []
        for name in order:
            per_step = []
            for _ in range(steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                made[name][0]()
                torch.cuda.synchronize()
                per_step.append(time.perf_counter() - t0)
            times[name].append(per_step)
    counts = {name: profiled(made[name][0]) for name in live}
    for _, close in made.values():
        close()
    return [times, counts, errors]


def summarise(model: str, times: Any, counts: Any, errors: Any) -> list[dict[str, Any]]:
    rows = []
    base = times.get(PLAIN)
    base_med = statistics.median(t for rnd in base for t in rnd) if base else math.nan
    base_rounds = [statistics.median(rnd) for rnd in base] if base else []
    for name, rounds in times.items():
        med = statistics.median(t for rnd in rounds for t in rnd)
        round_medians = [statistics.median(rnd) for rnd in rounds]
        paired = [m / b for m, b in zip(round_medians, base_rounds, strict=False)]
        rows.append(
            {
                "model": model,
                "method": name,
                "median_step_ms": med * 1e3,
                "spread_ms": [min(round_medians) * 1e3, max(round_medians) * 1e3],
                "ratio_to_plain": med / base_med,
                "paired_ratio_to_plain": statistics.median(paired) if paired else math.nan,
                "paired_spread": [min(paired), max(paired)] if paired else [math.nan] * 2,
                **counts[name],
                "error": None,
            }
        )
    rows += [{"model": model, "method": n, "error": e} for n, e in errors.items()]
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | method | median step (ms) | round medians min-max (ms) | vs plain "
        "| vs plain, per round: median [min, max] | host syncs/step | item()/step "
        "| cudaMemcpyAsync/step |",
        "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        if r["error"] is not None:
            lines.append(f"| {r['model']} | {r['method']} | failed: {r['error']} |||||||")
            continue
        lo, hi = r["spread_ms"]
        p_lo, p_hi = r["paired_spread"]
        lines.append(
            f"| {r['model']} | {r['method']} | {r['median_step_ms']:.2f} | {lo:.2f}-{hi:.2f} "
            f"| {r['ratio_to_plain']:.2f}x | {r['paired_ratio_to_plain']:.2f}x "
            f"[{p_lo:.2f}, {p_hi:.2f}] | {r['host_syncs']} | {r['item']} "
            f"| {r['cudaMemcpyAsync']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (>= 5)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--models", default=",".join(MODELS), help=", ".join(MODELS))
    parser.add_argument("--methods", default=",".join(CONTENDERS), help=", ".join(CONTENDERS))
    args = parser.parse_args(argv)
    if args.rounds < 5:
        parser.error("--rounds must be at least 5")
    models = [m for m in args.models.split(",") if m]
    methods = [PLAIN] + [m for m in args.methods.split(",") if m and m != PLAIN]
    unknown = [m for m in models if m not in MODELS] + [m for m in methods if m not in CONTENDERS]
    if unknown:
        parser.error(f"unknown model(s) or method(s): {unknown}")
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs CUDA, which this machine does not have", file=sys.stderr)
        return 2
    import gradhub

    rows: list[dict[str, Any]] = []
    with gradhub.init() as runtime:  # a job of one: the default group on this GPU
        for model in models:
            rows += summarise(model, *measure(model, methods, args.rounds, args.steps, runtime))
    table = markdown(rows)
    meta = {
        "machine": platform.platform(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "backend": "cpu:gloo,cuda:nccl, world of 1",
        "rounds": args.rounds,
        "steps_per_round": args.steps,
    }
    text = (
        f"{meta['gpu']}, torch {meta['torch']} (CUDA {meta['cuda']}), a world of 1; "
        f"{args.rounds} alternating rounds of {args.steps} steps; counts from one "
        f"profiled step.\n\n{table}\n"
    )
    write_results(args.out, "gpu", {"meta": meta, "rows": rows}, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
