"""The DDP-conformance job: every check of one strategy, run in sequence by each rank.

``conformance_job(rank, world, strategy, servers)`` (through ``run_ranks``)
runs each check of :data:`CHECKS` that applies to ``strategy`` and returns
``{check: {"value": ..., "seconds": s}}`` or ``{check: {"error": traceback}}``.
The pytest side (``test_conformance.py``) asserts per behaviour and strategy.

A check that fails on one rank can leave the other waiting in a collective
(until the group's timeout) and the process group out of step. So after each
check the ranks report to each other through the c10d store, and if any
failed, both tear the process group down and start a fresh one before the
next check: one failing behaviour never hides another.

Under ``ps-*`` every check names its model's parameters after itself
(:class:`Tagged`): the servers keep a key that exists already, so two checks
with the same parameter names would share values.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import gradhub

TIMEOUT = 15.0
"""Seconds a collective (and a push or pull) may wait: short, so a missing
behaviour that makes a rank wait shows as a failure within the suite's time."""

SYNC = ("allreduce", "sharded", "ps-sync")
"""Strategies whose ranks share every step (DDP's meaning applies as it is)."""

PER_PUSH = ("ps-async", "ps-ssp")
"""Strategies whose workers' pushes are applied on their own."""


# models and data ---------------------------------------------------------------


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def batch(step: int, micro: int, rank: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of micro-batch ``micro`` of step ``step``."""
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def loss_of(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


class Tagged(nn.Module):
    """``inner`` under the attribute ``tag``: parameter names unique to one check."""

    def __init__(self, tag: str, inner: nn.Module) -> None:
        super().__init__()
        self.tag = tag
        setattr(self, tag, inner)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, self.tag)(*args, **kwargs)


def arrays(model: nn.Module, buffers: bool = False) -> list[np.ndarray]:
    tensors = list(model.parameters()) + (list(model.buffers()) if buffers else [])
    return [t.detach().float().cpu().numpy().copy() for t in tensors]


def ddp(model: nn.Module, **kwargs: Any) -> nn.parallel.DistributedDataParallel:
    """DDP over the default (gloo) group: the reference in the same processes."""
    return nn.parallel.DistributedDataParallel(model, **kwargs)


def is_gradhub_error(exc: BaseException) -> dict[str, Any]:
    """What a refusal looked like: class, whether typed, whether it says what to do."""
    return {
        "class": type(exc).__name__,
        "typed": isinstance(exc, gradhub.GradhubError),
        "help": "- help:" in str(exc),
        "message": str(exc),
    }


# the context a check runs in -------------------------------------------------------


@dataclass
class Ctx:
    rank: int
    world: int
    strategy: str
    runtime: Any
    servers: dict[str, str]
    store: Any
    tag: str = ""
    dirty: bool = False
    """Set by a check that met a refusal that may leave a collective unmatched."""
    opened: list[Any] = field(default_factory=list)

    @property
    def sync(self) -> bool:
        """True where every step is shared by the ranks (DDP's meaning)."""
        return self.strategy in SYNC

    @property
    def ps(self) -> bool:
        return self.strategy.startswith("ps-")

    @property
    def alone(self) -> bool:
        """``ps-async``/``ps-ssp``: the checks step rank 0 alone (its pushes are
        applied on their own, so a single-process reference exists for them);
        rank 1 only prepares."""
        return self.strategy in PER_PUSH

    @property
    def share(self) -> float:
        """Where the ranks do not share steps, the reference is one process on
        this rank's batches with its gradient scaled by this: the push's share
        ``1 / world`` under ``ps-async``/``ps-ssp``, 1 under ``diloco`` (an inner
        step is the worker's own step)."""
        return 1.0 / self.world if self.alone else 1.0

    def prepare(self, model: nn.Module, optimizer: Any, **options: Any) -> tuple[Any, Any]:
        """``gradhub.prepare`` under this strategy; closed when the check ends."""
        if self.ps:
            model = Tagged(f"{self.tag}_{len(self.opened)}", model)
            options = {"servers": [self.servers[self.strategy]], "timeout": TIMEOUT, **options}
        prepared, opt = gradhub.prepare(
            model, optimizer, strategy=self.strategy, runtime=self.runtime, **options
        )
        self.opened.append(prepared)
        return prepared, opt

    def barrier(self, name: str) -> None:
        """Wait for every rank here, through the store (no collective)."""
        key = f"barrier/{self.tag}/{name}"
        self.store.add(key, 1)
        deadline = time.monotonic() + 2 * TIMEOUT
        while int(self.store.add(key, 0)) < self.world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"barrier {name!r} of check {self.tag!r}: a rank did not come")
            time.sleep(0.01)

    def gather(self, value: float) -> list[float]:
        """Every rank's ``value``, through the store (no collective)."""
        self.store.set(f"gather/{self.tag}/{self.rank}", repr(float(value)))
        keys = [f"gather/{self.tag}/{r}" for r in range(self.world)]
        self.store.wait(keys, timedelta(seconds=2 * TIMEOUT))
        return [float(self.store.get(k)) for k in keys]


Check = Callable[[Ctx], Any]
CHECKS: dict[str, tuple[Check, tuple[str, ...]]] = {}
"""name -> (check, the strategies it runs under). Filled by the check modules."""


def check(*strategies: str) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        CHECKS[fn.__name__.removeprefix("check_")] = (fn, strategies)
        return fn

    return register


ALL = ("allreduce", "sharded", "ps-sync", "ps-async", "ps-ssp", "diloco")


# the job ---------------------------------------------------------------------------


@contextlib.contextmanager
def _group(store: Any, generation: int, rank: int, world: int) -> Iterator[Any]:
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"conformance/{generation}", store),
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT),
    )
    runtime = gradhub.init(timeout=TIMEOUT)
    try:
        yield runtime
    finally:
        runtime.close()
        dist.destroy_process_group()


def conformance_job(
    rank: int, world: int, strategy: str, servers: dict[str, str], only: list[str] | None = None
) -> dict[str, Any]:
    # One torch thread per rank: two ranks share a 2-core machine, and spinning
    # intra-op threads of one rank would stall the other's collectives.
    torch.set_num_threads(1)
    import conformance_checks  # noqa: F401  (registers the checks, in this order)
    import conformance_checks_state  # noqa: F401
    import conformance_checks_surface  # noqa: F401

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=rank == 0,
        timeout=timedelta(seconds=4 * TIMEOUT),
    )
    names = [n for n, (_, where) in CHECKS.items() if strategy in where]
    names = [n for n in names if only is None or n in only]
    results: dict[str, Any] = {}
    generation = 0
    stack = contextlib.ExitStack()
    runtime = stack.enter_context(_group(store, generation, rank, world))
    try:
        for name in names:
            fn = CHECKS[name][0]
            ctx = Ctx(rank, world, strategy, runtime, servers, store, tag=f"c_{name}")
            start = time.monotonic()
            try:
                with contextlib.ExitStack() as closing:
                    closing.callback(lambda c=ctx: [m.close() for m in c.opened])
                    results[name] = {"value": fn(ctx)}
            except BaseException:
                results[name] = {"error": traceback.format_exc()}
            results[name]["seconds"] = time.monotonic() - start
            status = "fail" if "error" in results[name] or ctx.dirty else "ok"
            store.set(f"status/{name}/{rank}", status)
            keys = [f"status/{name}/{r}" for r in range(world)]
            try:
                store.wait(keys, timedelta(seconds=3 * TIMEOUT))
            except (RuntimeError, dist.DistError):
                results[name].setdefault("error", "the other rank did not finish this check")
                break
            if any(store.get(k) == b"fail" for k in keys):
                # The group may be out of step (a rank left a collective): a fresh one.
                stack.close()
                generation += 1
                stack = contextlib.ExitStack()
                runtime = stack.enter_context(_group(store, generation, rank, world))
    finally:
        stack.close()
    return results
