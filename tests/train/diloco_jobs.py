"""Jobs of the ``diloco`` tests, run in every rank by the harness, and DiLoCo
written out by hand in one process (the reference they are compared with)."""

from __future__ import annotations

import contextlib
import functools
import io
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import gradhub
from gradhub.transports.group import CollectiveGroup

TIMEOUT = 20.0
Arrays = list[np.ndarray]


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def norm_mlp(seed: int = 0) -> nn.Module:
    """With batch norm: buffers that each worker updates on its own."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def batch(step: int, rank: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step`` (``n`` samples)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def share(rank: int) -> int:
    """Uneven shares: rank 0 has 5 samples per step, rank 1 has 3."""
    return 5 if rank == 0 else 3


def sgd_momentum(model: nn.Module) -> torch.optim.Optimizer:
    """The inner optimizer of the hand-computed tests."""
    return torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)


def arrays(tensors: Any) -> Arrays:
    return [t.detach().float().cpu().numpy().copy() for t in tensors]


def loop(
    model: Any, opt: Any, rank: int, steps: range, *, samples: bool = False, n: int = 4
) -> None:
    """The plain DDP loop; with ``samples`` each rank weights by its :func:`share`."""
    for step in steps:
        count = share(rank) if samples else n
        x, y = batch(step, rank, count)
        opt.zero_grad()
        if samples:
            model.set_samples(count, 8)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


# the jobs ------------------------------------------------------------------------


def h1_against_allreduce(rank: int, world: int, steps: int) -> dict[str, Arrays]:
    """``allreduce`` with SGD, then ``diloco`` with H = 1, SGD inner, outer SGD lr 1."""
    torch.set_num_threads(1)
    out: dict[str, Arrays] = {}
    with gradhub.init(timeout=TIMEOUT) as runtime:
        for name, options in (
            ("allreduce", {}),
            ("diloco", {"inner_steps": 1, "outer_optimizer": _plain_sgd(1.0)}),
        ):
            base = mlp(seed=rank)  # set-up gives every rank rank 0's weights
            model, opt = gradhub.prepare(
                base,
                torch.optim.SGD(base.parameters(), lr=0.3),
                strategy=name,
                runtime=runtime,
                **options,
            )
            loop(model, opt, rank, range(steps))
            out[name] = arrays(base.parameters())
            model.close()
    return out


def _plain_sgd(lr: float) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    return functools.partial(torch.optim.SGD, lr=lr)


def weighted_and_quiet(rank: int, world: int, steps: int, inner_steps: int) -> dict[str, Any]:
    """Uneven ``set_samples`` shares; the collectives each step starts, counted."""
    torch.set_num_threads(1)
    with gradhub.init(timeout=TIMEOUT) as runtime, counting_collectives() as counts:
        base = norm_mlp(seed=rank)
        start = arrays(base.parameters())
        model, opt = gradhub.prepare(
            base,
            sgd_momentum(base),
            strategy="diloco",
            runtime=runtime,
            inner_steps=inner_steps,
        )
        per_step = []
        for step in range(steps):
            before = sum(counts.values())
            loop(model, opt, rank, range(step, step + 1), samples=True)
            per_step.append(sum(counts.values()) - before)
        gradhub.check_in_sync(model)  # steps % inner_steps == 0: just synced
        out = {
            "start": start,
            "params": arrays(base.parameters()),
            "buffers": arrays(b for b in base.buffers() if b.is_floating_point()),
            "per_step": per_step,
            "ops": dict(counts),
        }
        model.close()
    # The reference in this process: the same thread count, so the same kernels' bits.
    out["reference"] = by_hand(world, steps, inner_steps, sgd_momentum, samples=True, make=norm_mlp)
    return out


_COUNTED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "barrier")


@contextlib.contextmanager
def counting_collectives() -> Iterator[dict[str, int]]:
    """Counts every operation this process starts on a gradhub group (the job's
    transport) and every torch.distributed collective, inside the block."""
    counts: dict[str, int] = {}
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str) -> None:
        real = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[label] = counts.get(label, 0) + 1
            return real(*args, **kwargs)

        patched.append((owner, name, real))
        setattr(owner, name, counted)

    for method in ("begin", "submit", "call"):
        wrap(CollectiveGroup, method, f"group.{method}")
    for fn in _COUNTED:
        wrap(dist, fn, f"dist.{fn}")
    try:
        yield counts
    finally:
        for owner, name, real in reversed(patched):
            setattr(owner, name, real)


def resumed(rank: int, world: int, steps: int, inner_steps: int, **options: Any) -> dict[str, Any]:
    """An uninterrupted run, then runs stopped after ``k`` steps (between syncs and
    at one), saved per rank to bytes, resumed into fresh objects: final weights.
    ``options``: more of diloco's (with ``overlap``, a stop right after a sync
    leaves an exchange in flight)."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with gradhub.init(timeout=TIMEOUT) as runtime:

        def start(seed: int) -> tuple[nn.Module, Any, Any]:
            base = mlp(seed=seed)
            model, opt = gradhub.prepare(
                base,
                torch.optim.AdamW(base.parameters(), lr=0.02),
                strategy="diloco",
                runtime=runtime,
                inner_steps=inner_steps,
                **options,
            )
            return base, model, opt

        def finish(base: nn.Module, model: Any) -> dict[str, Arrays]:
            done = {"params": arrays(base.parameters()), "shared": arrays(model.strategy.shared)}
            model.close()
            return done

        base, model, opt = start(0)
        loop(model, opt, rank, range(steps), samples=True)
        out["uninterrupted"] = finish(base, model)
        for k, how in ((inner_steps + 1, "files"), (inner_steps, "files"), (2, "strategy")):
            base, model, opt = start(0)
            loop(model, opt, rank, range(k), samples=True)
            if how == "files":  # as fit and a DDP script save: model, then optimizer
                saved = _bytes({"model": model.state_dict(), "optimizer": opt.state_dict()})
            else:
                saved = _bytes(
                    {"model": model.state_dict(), "strategy": model.strategy.state_dict()}
                )
            model.close()
            base, model, opt = start(7)  # other weights: the load must bring them all
            state = torch.load(io.BytesIO(saved), weights_only=True)
            model.load_state_dict(state["model"])
            if how == "files":
                opt.load_state_dict(state["optimizer"])
            else:
                model.strategy.load_state_dict(state["strategy"])
            loop(model, opt, rank, range(k, steps), samples=True)
            out[f"{how} {k}"] = finish(base, model)
    return out


def loss_scalers(rank: int, world: int) -> dict[str, Any]:
    """H = 2; step 0 overflows on rank 1. ``gradhub.GradScaler``: rank 1 skips its
    own step, which counts as an inner step, and both sync at step 1.
    ``torch.amp.GradScaler``: rank 1 does not call ``step`` at step 0, so its
    second ``step`` comes one backward later; the sync must say so."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with gradhub.init(timeout=TIMEOUT) as runtime:
        for name in ("gradhub", "torch"):
            base = mlp()
            model, opt = gradhub.prepare(
                base, sgd_momentum(base), strategy="diloco", runtime=runtime, inner_steps=2
            )
            scaler: Any = (
                gradhub.GradScaler(opt, init_scale=2.0**8)
                if name == "gradhub"
                else torch.amp.GradScaler("cpu", init_scale=2.0**8)
            )
            try:
                for step in range(3 if name == "torch" else 2):
                    x, y = batch(step, rank)
                    opt.zero_grad()
                    loss = nn.functional.cross_entropy(model(x), y)
                    if (step, rank) == (0, 1):
                        loss = loss * float("inf")
                    scaler.scale(loss).backward()
                    scaler.step(opt)
                    scaler.update()
                gradhub.check_in_sync(model)
                out[name] = {"skipped": model.strategy.skipped_steps, "synced": True}
            except gradhub.GradhubError as exc:
                out[name] = {"error": type(exc).__name__, "message": str(exc)}
            model.close()
    return out


def _bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


# DiLoCo by hand, in one process ------------------------------------------------------


def by_hand(
    world: int,
    steps: int,
    inner_steps: int,
    inner: Callable[[nn.Module], torch.optim.Optimizer],
    *,
    outer_lr: float = 0.7,
    momentum: float = 0.9,
    samples: bool = False,
    make: Callable[[], nn.Module] = mlp,
) -> tuple[Arrays, Arrays]:
    """Every worker's plain model and inner optimizer, stepped in turn; at every
    ``inner_steps``-th step the outer step written out: pseudo-gradients
    ``shared - local`` weighted (1 each, or the samples since the last sync),
    averaged, then SGD with Nesterov momentum on the shared weights, which
    every worker takes, with worker 0's buffers. Returns (worker 0's weights,
    the shared weights)."""
    workers = [make() for _ in range(world)]
    opts = [inner(w) for w in workers]
    shared = [p.detach().clone() for p in workers[0].parameters()]
    buffers: list[torch.Tensor | None] = [None] * len(shared)
    seen = [0] * world
    for step in range(steps):
        for r, (w, o) in enumerate(zip(workers, opts, strict=True)):
            loop(w, _Plain(o), r, range(step, step + 1), n=share(r) if samples else 4)
            seen[r] += share(r)
        if (step + 1) % inner_steps:
            continue
        weights = [float(seen[r]) if samples else 1.0 for r in range(world)]
        with torch.no_grad():
            for i, s in enumerate(shared):
                total = sum(weights)
                summed = sum(
                    (s - list(w.parameters())[i]) * k for w, k in zip(workers, weights, strict=True)
                )
                average = summed / total if total != 1.0 else summed
                buf = buffers[i]
                if buf is None:
                    buf = buffers[i] = average.clone()
                else:
                    buf.mul_(momentum).add_(average)
                s.add_(average.add(buf, alpha=momentum), alpha=-outer_lr)
            for w in workers:
                for p, s in zip(w.parameters(), shared, strict=True):
                    p.copy_(s)
                for b, b0 in zip(w.buffers(), workers[0].buffers(), strict=True):
                    b.copy_(b0)
        seen = [0] * world
    return arrays(workers[0].parameters()), arrays(shared)


class _Plain:
    """A plain optimizer under the loop's ``zero_grad``/``step`` (no set_samples)."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self.opt = opt

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def step(self) -> None:
        self.opt.step()


# streaming DiLoCo -------------------------------------------------------------------


def streaming(rank: int, world: int, steps: int) -> dict[str, Any]:
    """Streaming runs on every rank, each beside its hand computation (made in this
    process): per run the final weights, the shared weights and, per step, the
    fragments whose exchange started and the group operations submitted."""
    from gradhub.train.strategies.diloco import exchange

    torch.set_num_threads(1)
    runs: dict[str, dict[str, Any]] = {
        "fragments": {"inner_steps": 6, "fragments": 3, "overlap": 1},
        "blocking": {"inner_steps": 3, "fragments": 1, "overlap": 0, "compress": "none"},
        "bf16": {"inner_steps": 4, "fragments": 2, "overlap": 1, "compress": "bf16"},
        "fp4": {"inner_steps": 4, "fragments": 2, "overlap": 0, "compress": "fp4"},
        "weighted": {"inner_steps": 4, "fragments": 2, "overlap": 1, "compress": "fp4"},
    }
    out: dict[str, Any] = {}
    real_start = exchange.start
    with gradhub.init(timeout=TIMEOUT) as runtime:
        for name, options in runs.items():
            weighted = name == "weighted"  # set_samples: rank 0 5 per step, rank 1 3
            started: list[tuple[int, int]] = []  # (step, elements) of each exchange
            current: list[Any] = []  # the model of this run

            def recording(
                flat: torch.Tensor, *args: Any, log: Any = started, m: Any = current
            ) -> Any:
                log.append((m[0].strategy.steps, flat.numel()))
                return real_start(flat, *args)

            exchange.start = recording  # type: ignore[assignment]
            try:
                base = mlp(seed=rank)
                model, opt = gradhub.prepare(
                    base, sgd_momentum(base), strategy="diloco", runtime=runtime, **options
                )
                current.append(model)
                with counting_collectives() as counts:
                    per_step = []
                    for step in range(steps):
                        before = counts.get("group.submit", 0)
                        loop(model, opt, rank, range(step, step + 1), samples=weighted)
                        per_step.append(counts.get("group.submit", 0) - before)
                out[name] = {
                    "params": arrays(base.parameters()),
                    "shared": arrays(model.strategy.shared),
                    "started": started,
                    "submits": per_step,
                    "fragments": [list(f) for f in model.strategy.fragments],
                }
                model.close()
            finally:
                exchange.start = real_start  # type: ignore[assignment]
            h, f, tau = options["inner_steps"], options["fragments"], options["overlap"]
            codec = options.get("compress", "none")
            out[name]["reference"] = streaming_by_hand(
                world, steps, h, f, tau, codec, samples=weighted
            )
    return out


def streaming_by_hand(
    world: int,
    steps: int,
    inner_steps: int,
    count: int,
    tau: int,
    compress: str,
    *,
    samples: bool = False,
) -> tuple[Arrays, Arrays]:
    """Streaming DiLoCo written out: ``world`` plain workers (:func:`mlp`, SGD with
    momentum inside, 4 samples each per step and weight 1, or with ``samples``
    :func:`share`'s and the samples since the fragment's sync started as the
    weight); fragment ``f`` (the parameters that
    :func:`~gradhub.train.strategies.diloco.fragments.cut` gives) starts its sync
    after step ``n`` with ``n % H == f * H // F``: each worker's
    ``shared - local`` times its weight, through ``decode(encode(.))`` for a
    codec, summed in rank order, divided by the summed weights, Nesterov SGD
    (lr 0.7, momentum 0.9) on the fragment's shared weights ``tau`` steps later,
    when each worker's fragment becomes ``shared + (local - local at the
    start)``. Returns (worker 0's weights, the shared weights)."""
    from gradhub import codecs
    from gradhub.train.strategies.diloco.fragments import cut

    workers = [mlp() for _ in range(world)]
    opts = [sgd_momentum(w) for w in workers]
    params = [list(w.parameters()) for w in workers]
    shared = [p.detach().clone() for p in params[0]]
    momentum: list[torch.Tensor | None] = [None] * len(shared)
    groups = cut([p.numel() for p in shared], count)
    codec = None if compress == "none" else codecs.get(compress, for_="diloco")
    pending: tuple[int, int, Any, Any, float] | None = None  # fragment, step, sum, starts, W
    seen = [[0] * world for _ in range(count)]  # samples since each fragment's sync

    def merge(
        f: int, summed: list[torch.Tensor], starts: list[list[torch.Tensor]], weight: float
    ) -> None:
        for k, i in enumerate(groups[f]):
            average = summed[k] / weight if weight != 1.0 else summed[k]
            buf = momentum[i]
            if buf is None:
                buf = momentum[i] = average.clone()
            else:
                buf.mul_(0.9).add_(average)
            shared[i].add_(average.add(buf, alpha=0.9), alpha=-0.7)
            for r in range(world):
                p = params[r][i]
                p.copy_(shared[i] if tau == 0 else shared[i] + (p - starts[r][k]))

    for step in range(1, steps + 1):
        for r, (w, o) in enumerate(zip(workers, opts, strict=True)):
            loop(w, _Plain(o), r, range(step - 1, step), n=share(r) if samples else 4)
            for f in range(count):
                seen[f][r] += share(r)
        with torch.no_grad():
            if pending is not None and pending[1] == step:
                fragment, _, summed, starts, weight = pending
                merge(fragment, summed, starts, weight)
                pending = None
            for f in range(count):
                if step % inner_steps != f * inner_steps // count:
                    continue
                # The fragment's pseudo-gradient is one flat vector (one codec call).
                deltas = [
                    torch.cat([(shared[i] - params[r][i]).reshape(-1) for i in groups[f]])
                    for r in range(world)
                ]
                weights = [float(n) if samples else 1.0 for n in seen[f]]
                seen[f] = [0] * world
                deltas = [d * k if k != 1.0 else d for d, k in zip(deltas, weights, strict=True)]
                if codec is not None:
                    deltas = [codec.decode(codec.encode(d)) for d in deltas]
                total = deltas[0].clone()
                for d in deltas[1:]:
                    total.add_(d)
                sizes = [shared[i].numel() for i in groups[f]]
                summed = [
                    t.view_as(shared[i]) for t, i in zip(total.split(sizes), groups[f], strict=True)
                ]
                starts = [[params[r][i].detach().clone() for i in groups[f]] for r in range(world)]
                if tau == 0:
                    merge(f, summed, starts, sum(weights))
                else:
                    pending = (f, step + tau, summed, starts, sum(weights))
    return arrays(params[0]), arrays(shared)
