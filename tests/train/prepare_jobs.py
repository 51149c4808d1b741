"""Jobs of the own-loop tests (``gradhub.prepare``), run in every rank by the harness."""

from __future__ import annotations

import contextlib
import io
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

import gradhub
from gradhub.transports import choice as transport
from train_helpers import counting_backend_all_reduce

ModelMaker = Callable[[], nn.Module]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


MODELS: dict[str, ModelMaker] = {"mlp": mlp, "cnn": SmallCNN}


def batch(kind: str, step: int, micro: int, rank: int, n: int = 3) -> tuple[torch.Tensor, ...]:
    """This rank's part of micro-batch ``micro`` of step ``step``."""
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    shape = (n, 6) if kind == "mlp" else (n, 1, 6, 6)
    return torch.randn(*shape, generator=g), torch.randint(0, 3, (n,), generator=g)


def global_batch(kind: str, step: int, micro: int, world: int) -> tuple[torch.Tensor, ...]:
    parts = [batch(kind, step, micro, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def make_optimizer(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)


def train(
    model: Any,
    opt: torch.optim.Optimizer,
    kind: str,
    rank: int,
    world: int,
    *,
    steps: int = 5,
    clip: Callable[[], Any] | None = None,
    no_sync: Callable[[], Any] | None = None,
    single: bool = False,
) -> None:
    """The loop under test: 2-step accumulation, clipping, StepLR, an LR change at step 3."""
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(steps):
        if step == 3:  # a change by hand, on top of the schedule
            for group in opt.param_groups:
                group["lr"] = group["lr"] * 0.3
        opt.zero_grad()
        for micro in range(2):
            x, y = (
                global_batch(kind, step, micro, world) if single else batch(kind, step, micro, rank)
            )
            quiet = no_sync() if (no_sync is not None and micro == 0) else contextlib.nullcontext()
            with quiet:
                # Halved: the mean over both micro-batches, as a single process would.
                (nn.functional.cross_entropy(model(x), y) / 2).backward()
        if clip is not None:
            clip()
        opt.step()
        sched.step()


def params(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def single_process_run(
    kind: str, optimizer: str, world: int
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The reference: one process on the concatenated batches, same schedule."""
    model = MODELS[kind]()
    opt = make_optimizer(optimizer, model)
    train(
        model,
        opt,
        kind,
        0,
        world,
        single=True,
        clip=lambda: nn.utils.clip_grad_norm_(model.parameters(), 0.5),
    )
    return model, opt


def single_process(kind: str, optimizer: str, world: int) -> list[np.ndarray]:
    return params(single_process_run(kind, optimizer, world)[0])


def own_loop(rank: int, world: int, cases: list[tuple[str, str, str, dict[str, Any]]]) -> Any:
    """Run each (strategy, model, optimizer, options) case; DDP beside allreduce/sharded."""
    runtime = gradhub.init(timeout=30)
    out: dict[str, Any] = {}
    try:
        for strategy, kind, optimizer, options in cases:
            base = MODELS[kind]()
            model, opt = gradhub.prepare(
                base,
                make_optimizer(optimizer, base),
                strategy=strategy,
                runtime=runtime,
                **options,
            )
            with model, counting_backend_all_reduce() as backend:
                train(
                    model,
                    opt,
                    kind,
                    rank,
                    world,
                    clip=lambda m=model: gradhub.clip_grad_norm_(m, 0.5),
                    no_sync=model.no_sync,
                )
                gradhub.check_in_sync(model)  # every rank holds the same bits
                suffix = f"/{options['compress']}" if "compress" in options else ""
                if strategy == "sharded" and "bucket_mb" in options:
                    suffix = "/buckets"
                out[f"{strategy}/{kind}{suffix}"] = params(model.module)
                # 16-bit all-reduces the backend ran (none: the group's transport ran them)
                out[f"{strategy}/{kind}{suffix}/backend16"] = (
                    backend[torch.float16] + backend[torch.bfloat16]
                )
                if strategy.startswith("ps-"):
                    out[f"{strategy}/state"] = _state_round_trip(opt)
            if strategy in ("allreduce", "sharded") and f"ddp/{kind}" not in out:
                ref = MODELS[kind]()
                ddp = nn.parallel.DistributedDataParallel(ref)
                ddp_opt = make_optimizer(optimizer, ref)
                train(
                    ddp,
                    ddp_opt,
                    kind,
                    rank,
                    world,
                    clip=lambda d=ddp: nn.utils.clip_grad_norm_(d.parameters(), 0.5),
                    no_sync=ddp.no_sync,
                )
                out[f"ddp/{kind}"] = params(ref)
        out["transport"] = transport.chosen(runtime.group)
    finally:
        runtime.close()
    return out


def _state_round_trip(opt: torch.optim.Optimizer) -> bytes:
    """The servers' state as a state dict; then another one sent and read back."""
    state = opt.state_dict()  # collective: every rank calls it
    changed = {
        "state": {
            i: {k: v if k == "step" else v * 0.5 for k, v in entry.items()}
            for i, entry in state["state"].items()
        },
        "param_groups": [{**g, "lr": g["lr"] * 0.5} for g in state["param_groups"]],
    }
    opt.load_state_dict(changed)  # rank 0 sends it to the servers
    return to_bytes((state, changed, opt.state_dict()))


def to_bytes(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def two_groups(model: nn.Module) -> torch.optim.Optimizer:
    """Adam with two parameter groups (weights decayed, biases not)."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return torch.optim.Adam(
        [{"params": weights, "weight_decay": 0.01}, {"params": biases, "lr": 0.02}], lr=0.01
    )


def plain_steps(
    model: Any, opt: torch.optim.Optimizer, rank: int, world: int, steps: range
) -> None:
    """Steps on global batches of 6 (split evenly over ``world`` ranks)."""
    for step in steps:
        x, y = global_batch("mlp", step, 0, 1)
        x, y = torch.cat([x, x + 1]), torch.cat([y, (y + 1) % 3])  # 6 samples
        share = 6 // world
        opt.zero_grad()
        mine = slice(rank * share, (rank + 1) * share)
        nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
        opt.step()


def sharded_save(rank: int, world: int, checkpoints: str) -> Any:
    """3 steps of a 2-rank sharded job; returns the model and the full optimizer state.
    Then 1 epoch of ``fit`` (sharded) checkpointed into ``checkpoints``."""
    runtime = gradhub.init(timeout=30)
    try:
        base = mlp()
        model, opt = gradhub.prepare(base, two_groups(base), strategy="sharded", runtime=runtime)
        with model:
            plain_steps(model, opt, rank, world, range(3))
            state = opt.state_dict()  # collective: every rank calls it
            weights = model.state_dict()
        fit_sharded(runtime, checkpoints, epochs=1)
        return to_bytes((weights, state))  # tensors do not cross processes by pickling
    finally:
        runtime.close()


def sharded_resume(rank: int, world: int, saved: bytes, checkpoints: str) -> Any:
    """The saved state continued for 2 steps; and the ``fit`` run resumed for its 2nd epoch."""
    weights, state = from_bytes(saved)
    runtime = gradhub.init(timeout=30)
    try:
        base = mlp()
        model, opt = gradhub.prepare(base, two_groups(base), strategy="sharded", runtime=runtime)
        with model:
            model.load_state_dict(weights)
            opt.load_state_dict(state)
            plain_steps(model, opt, rank, world, range(3, 5))
            own = params(model.module)
        return own, fit_sharded(runtime, checkpoints, epochs=2)
    finally:
        runtime.close()


def fit_sharded(runtime: Any, checkpoints: str | None, epochs: int) -> tuple[int, list[np.ndarray]]:
    """``fit`` of the MLP with the two-group Adam and a StepLR, 3 steps per epoch;
    ``(start step, parameters)``. Resumes from ``checkpoints`` when it has one."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 6, generator=g)
    y = torch.randint(0, 3, (24,), generator=g)
    model = mlp()
    strategy = "sharded" if runtime.world_size > 1 else "allreduce"
    with gradhub.DataParallelTrainer(
        model, two_groups(model), strategy=strategy, runtime=runtime
    ) as trainer:
        result = trainer.fit(
            (x, y),
            epochs=epochs,
            batch_size=8,  # global: 4+4 on 2 ranks, 3+3+2 on 3 (weighted by samples)
            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5),
            checkpoint_dir=checkpoints,
            resume=checkpoints is not None,
            progress=False,
        )
    return result.start_step, params(model)


def misuse_and_uneven(rank: int, world: int, servers: dict[str, str]) -> dict[str, Any]:
    """Uneven batches weighted by set_samples; each misuse under every strategy (the
    servers' keys exist by then: the misuse runs pull what the earlier runs left)."""
    runtime = gradhub.init(timeout=30)
    try:
        out = {
            "uneven": _uneven(rank, runtime, servers),
            "clip ps-async": _clip_per_worker(rank, runtime, servers["ps-async"]),
            "clip compiled": _clip_compiled(rank, runtime),
        }
        out["misuse"] = {
            s: _misuse(rank, runtime, s, servers.get(s))
            for s in ("allreduce", "sharded", "ps-sync", "ps-async", "ps-ssp")
        }
        return out
    finally:
        runtime.close()


def _uneven(rank: int, runtime: Any, servers: dict[str, str]) -> dict[str, list[np.ndarray]]:
    """3 steps with rank 0 on 5 samples and rank 1 on 3, weighted by ``set_samples``."""
    out: dict[str, list[np.ndarray]] = {}
    for strategy in ("allreduce", "sharded", "ps-sync"):
        base = mlp()
        options = {"servers": [servers[strategy]]} if strategy in servers else {}
        model, opt = gradhub.prepare(
            base, make_optimizer("sgd", base), strategy=strategy, runtime=runtime, **options
        )
        with model:
            for step in range(3):
                x, y = global_batch("mlp", step, 0, 1)  # 3 samples
                x2, y2 = batch("mlp", step, 1, 0, n=5)
                x, y = (x2, y2) if rank == 0 else (x, y)
                opt.zero_grad()
                model.set_samples(len(x))  # the global count is summed on the way
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
            out[strategy] = params(model.module)
    return out


def _grad_norm(model: nn.Module) -> float:
    return float(
        torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    )


def _clip_per_worker(rank: int, runtime: Any, server: str) -> dict[str, float]:
    """Under ps-async each worker clips its own gradient by its own norm."""
    base = mlp()
    model, opt = gradhub.prepare(
        base, make_optimizer("sgd", base), strategy="ps-async", runtime=runtime, servers=[server]
    )
    with model:
        x, y = batch("mlp", 0, 0, rank, n=3 + 3 * rank)  # different data, different norms
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        own = _grad_norm(model.module)
        norm = float(gradhub.clip_grad_norm_(model, 0.05))
        after = _grad_norm(model.module)
        opt.step()
    return {"own": own, "norm": norm, "after": after}


def compiled(model: nn.Module) -> nn.Module:
    """``torch.compile(model)``: the wrapper only, nothing is compiled until it
    is called. (torch's first ``torch.compile`` imports modules that warn about
    ``torch.jit`` deprecations: torch's own warning, not this code's.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.compile(model)  # type: ignore[return-value]


def _clip_compiled(rank: int, runtime: Any) -> dict[str, float]:
    """gradhub.clip_grad_norm_ of ``torch.compile`` of the prepared model (the
    wrapper is made without compiling anything: the model is never called
    through it here)."""
    base = mlp()
    model, opt = gradhub.prepare(base, make_optimizer("sgd", base), runtime=runtime)
    with model:
        x, y = batch("mlp", 0, 0, rank, n=3 + 3 * rank)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        combined = _grad_norm(model.module)
        norm = float(gradhub.clip_grad_norm_(compiled(model), 0.05))
        after = _grad_norm(model.module)
    return {"combined": combined, "norm": norm, "after": after}


def uneven_reference() -> list[np.ndarray]:
    model = mlp()
    opt = make_optimizer("sgd", model)
    for step in range(3):
        x, y = global_batch("mlp", step, 0, 1)
        x2, y2 = batch("mlp", step, 1, 0, n=5)
        opt.zero_grad()
        nn.functional.cross_entropy(model(torch.cat([x2, x])), torch.cat([y2, y])).backward()
        opt.step()
    return params(model)


def _misuse(rank: int, runtime: Any, strategy: str, server: str | None) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    base = mlp()
    original = make_optimizer("sgd", base)  # the spec the servers' keys were made with
    options = {"servers": [server]} if server is not None else {}
    model, opt = gradhub.prepare(base, original, strategy=strategy, runtime=runtime, **options)
    x, y = batch("mlp", 0, 0, rank)
    with model:
        seen["module is the original"] = model.module is base
        seen["keys"] = (list(model.state_dict()), list(base.state_dict()))
        nn.functional.cross_entropy(model(x), y).backward()
        try:
            original.step()
        except gradhub.MisuseError as exc:
            seen["original"] = str(exc)
        # A second synchronising backward before step is allowed (DDP's meaning);
        # checked here under allreduce, by the conformance tests under the others.
        if strategy == "allreduce":
            nn.functional.cross_entropy(model(x), y).backward()
            seen["second backward"] = "allowed"
        opt.step()
        opt.zero_grad()
        with model.no_sync():
            nn.functional.cross_entropy(model(x), y).backward()
        try:
            opt.step()
        except gradhub.MisuseError as exc:
            seen["no sync"] = str(exc)
        # ps-async/ssp: each worker's push was applied before its step returned;
        # once both have returned, a pull sees both.
        runtime.all_reduce_sum(torch.zeros(1), where="misuse: steps done")
        gradhub.check_in_sync(model)  # still equal: nothing diverged
        if rank == 1:
            with torch.no_grad():
                next(model.parameters()).add_(1e-7)
        try:
            # ps-*: check_in_sync pulls the servers' values first, which replace
            # the local change: the replicas are equal again and it passes.
            gradhub.check_in_sync(model)
            seen["in sync after a local change"] = "yes"
        except gradhub.ReplicasDivergedError as exc:
            seen["diverged"] = str(exc)
    return seen
