"""Jobs of the ``diloco`` tests with parameter servers (``servers=``), run in every
rank by the harness; the servers are processes the test started."""

from __future__ import annotations

import io
import time
from typing import Any

import torch
from torch import nn

import gradhub
from diloco_jobs import TIMEOUT, arrays, loop, mlp, sgd_momentum

RUNS: dict[str, dict[str, Any]] = {
    "plain": {"inner_steps": 3},
    "weighted": {"inner_steps": 3},  # uneven set_samples
    "streaming": {"inner_steps": 4, "fragments": 2, "overlap": 1, "compress": "bf16"},
}
"""The runs compared with and without servers; each gets a sync server of its own."""


def with_and_without_servers(
    rank: int, world: int, steps: int, addresses: dict[str, str]
) -> dict[str, Any]:
    """Each run of :data:`RUNS` without servers, then with the servers at
    ``addresses[run]`` (mode sync): final weights and shared weights."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with gradhub.init(timeout=TIMEOUT) as runtime:
        for run, options in RUNS.items():
            for where, servers in (("local", None), ("servers", [addresses[run]])):
                base = mlp(seed=rank)  # set-up gives every rank rank 0's weights
                model, opt = gradhub.prepare(
                    base,
                    sgd_momentum(base),
                    strategy="diloco",
                    runtime=runtime,
                    servers=servers,
                    timeout=TIMEOUT,
                    **options,
                )
                loop(model, opt, rank, range(steps), samples=run == "weighted")
                model.close()  # waits for a sync in flight
                out[f"{run} {where}"] = {
                    "params": arrays(base.parameters()),
                    "shared": arrays(model.strategy.shared),
                }
    return out


def staleness(
    rank: int, world: int, steps: int, inner_steps: int, address: str, slow: float
) -> dict[str, Any]:
    """``diloco_mode="async"`` against servers in ssp mode; the last rank sleeps
    ``slow`` seconds per inner step. After each of its syncs a rank records its
    own count of pushes and every other worker's, as the servers report them
    (read once its pull returned), and the time."""
    torch.set_num_threads(1)
    with gradhub.init(timeout=TIMEOUT) as runtime:
        base = mlp()
        model, opt = gradhub.prepare(
            base,
            sgd_momentum(base),
            strategy="diloco",
            runtime=runtime,
            inner_steps=inner_steps,
            servers=[address],
            diloco_mode="async",
            timeout=TIMEOUT,
        )
        strategy: Any = model.strategy
        servers = strategy.servers
        first = servers.names[0]
        seen: list[dict[str, int]] = []
        for step in range(steps):
            if rank == world - 1:
                time.sleep(slow)
            loop(model, opt, rank, range(step, step + 1))
            if strategy.inner_done == 0:  # synced: pushed, and pulled
                counts = servers.steps()[first]
                seen.append({str(w): n for w, n in counts.items()})
        out = {"seen": seen, "params": arrays(base.parameters())}
        model.close()
    return out


def resumed_with_servers(
    rank: int, world: int, steps: int, inner_steps: int, stop: int, address: str, **options: Any
) -> dict[str, Any]:
    """Without servers, ``steps`` steps (the reference). With the servers at
    ``address``: ``stop`` steps (between syncs, or with a sync in flight under
    ``overlap``), saved per rank as ``fit`` saves (model, then optimizer),
    closed; then fresh objects with other weights, prepared against the same
    servers (which pull the servers' shared weights), loaded, and the remaining
    steps. ``options``: more of diloco's, for every run."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with gradhub.init(timeout=TIMEOUT) as runtime:

        def start(seed: int, servers: list[str] | None) -> tuple[nn.Module, Any, Any]:
            base = mlp(seed=seed)
            model, opt = gradhub.prepare(
                base,
                torch.optim.AdamW(base.parameters(), lr=0.02),
                strategy="diloco",
                runtime=runtime,
                inner_steps=inner_steps,
                servers=servers,
                timeout=TIMEOUT,
                **options,
            )
            return base, model, opt

        base, model, opt = start(0, None)
        loop(model, opt, rank, range(steps), samples=True)
        out["uninterrupted"] = {
            "params": arrays(base.parameters()),
            "shared": arrays(model.strategy.shared),
        }
        model.close()
        base, model, opt = start(0, [address])
        loop(model, opt, rank, range(stop), samples=True)
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
        out["saved outer"] = opt.state_dict()["diloco"]["outer"]
        out["in flight"] = model.strategy._pending is not None
        out["shared at stop"] = arrays(model.strategy.shared)
        model.close()
        base, model, opt = start(7, [address])
        out["pulled"] = arrays(base.parameters())  # before any load: the servers' weights
        state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        loop(model, opt, rank, range(stop, steps), samples=True)
        out["resumed"] = {
            "params": arrays(base.parameters()),
            "shared": arrays(model.strategy.shared),
        }
        model.close()
    return out
