"""Jobs of the DDP-surface tests: each check runs DDP and ``gradhub.prepare``
(``allreduce``) in the same 2 processes, on the same gloo group, and compares."""

from __future__ import annotations

import io
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel as DDP

import gradhub

Loop = Callable[[Any, list[torch.optim.Optimizer], int], None]


class Net(nn.Module):
    """Seeded per rank, so set-up must make the replicas equal."""

    def __init__(self, seed: int, *, bn: bool = False, frozen: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16) if bn else None
        self.frozen = nn.Linear(6, 16).requires_grad_(False) if frozen else None
        self.b = nn.Linear(16, 3)
        self.extra = nn.Linear(16, 3)  # used on rank 0 only where the loop says so
        self.never = nn.Linear(16, 3)  # used by no rank

    def forward(self, x: torch.Tensor, extra: bool = False) -> torch.Tensor:
        h = self.a(x)
        if self.frozen is not None:
            h = h + self.frozen(x)
        if self.bn is not None:
            h = self.bn(h)
        h = torch.tanh(h)
        out = self.b(h)
        return out + self.extra(h) if extra else out


class Lion(torch.optim.Optimizer):
    """A custom optimizer class (sign of a momentum mix), as a user would write one."""

    def __init__(self, params: Any, lr: float = 0.01, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                p.add_(torch.sign(m * group["beta"] + p.grad), alpha=-group["lr"])
                m.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
        return None


def data(step: int, micro: int, rank: int, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g)


def loss_of(model: Any, step: int, micro: int, rank: int, extra: bool = False) -> torch.Tensor:
    x, y = data(step, micro, rank)
    return nn.functional.cross_entropy(model(x, extra), y)


def adamw(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)]


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def both(
    rank: int,
    loop: Loop,
    make: Callable[[], nn.Module] = lambda: Net(0),
    optimizers: Callable[[nn.Module], list[torch.optim.Optimizer]] = adamw,
    ddp: dict[str, Any] | None = None,
    hook: Any = None,
    hook_state: Callable[[], Any] = lambda: None,
) -> dict[str, Any]:
    """Run ``loop`` under DDP and under gradhub; the largest difference and both states."""
    out: dict[str, Any] = {}
    for kind in ("ddp", "gradhub"):
        base = make()
        opts = optimizers(base)
        if kind == "ddp":
            # DDP raises on a model with unused parameters unless told to find them.
            with warnings.catch_warnings():  # broadcast_buffers is deprecated in torch 2.13
                warnings.simplefilter("ignore", FutureWarning)
                model: Any = DDP(base, **{"find_unused_parameters": True, **(ddp or {})})
            if hook is not None:
                model.register_comm_hook(hook_state(), getattr(hook, "for_ddp", hook))
            loop(model, opts, rank)
        else:
            model, prepared = gradhub.prepare(base, opts, **(ddp or {}))
            if hook is not None:
                model.register_comm_hook(hook_state(), hook)
            with model:
                loop(model, prepared, rank)
        out[kind] = state_of(base)
        out[kind + " grads"] = {n: p.grad for n, p in base.named_parameters()}
    out["diff"] = max_diff(out["ddp"], out["gradhub"])
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """0.0 when bit for bit equal; inf when any tensor differs in dtype or presence."""
    if a.keys() != b.keys():
        return float("inf")
    worst = 0.0
    for k in a:
        if not torch.equal(a[k], b[k]):
            worst = max(worst, float((a[k].double() - b[k].double()).abs().max()) or 1e-300)
    return worst


# the loops: each a plain DDP loop ----------------------------------------------------


def nanogpt_loop(model: Any, opts: list[Any], rank: int) -> None:
    """nanoGPT's accumulation: the attribute set per micro-step; torch's clip."""
    for step in range(3):
        for micro in range(3):
            model.require_backward_grad_sync = micro == 2
            loss_of(model, step, micro, rank).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opts[0].step()
        opts[0].zero_grad(set_to_none=True)


def repeated_sync_loop(model: Any, opts: list[Any], rank: int) -> None:
    """Every micro-step's backward synchronises (DDP allows it); zero_grad to zeros."""
    for step in range(2):
        for micro in range(3):
            loss_of(model, step, micro, rank).backward()
        opts[0].step()
        opts[0].zero_grad(set_to_none=False)


def forward_decides_loop(model: Any, opts: list[Any], rank: int) -> None:
    """DDP decides at forward: a forward inside no_sync() makes a backward outside
    it local; a forward outside makes a backward inside it synchronise."""
    for step in range(2):
        with model.no_sync():
            loss = loss_of(model, step, 0, rank)
        loss.backward()
        loss = loss_of(model, step, 1, rank)
        with model.no_sync():
            loss.backward()
        opts[0].step()
        opts[0].zero_grad()


def unused_loop(model: Any, opts: list[Any], rank: int) -> None:
    """``extra`` used on rank 0 only in steps 0 and 2; ``never`` by no rank."""
    for step in range(4):
        loss_of(model, step, 0, rank, extra=rank == 0 and step % 2 == 0).backward()
        opts[0].step()
        opts[0].zero_grad()


def clip_loop(clip: str) -> Loop:
    def loop(model: Any, opts: list[Any], rank: int) -> None:
        for step in range(5):
            loss_of(model, step, 0, rank).backward()
            if clip == "gradhub" and isinstance(model, gradhub.PreparedModel):
                gradhub.clip_grad_norm_(model, 0.05)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opts[0].step()
            opts[0].zero_grad()

    return loop


def buffers_loop(model: Any, opts: list[Any], rank: int) -> None:
    """BatchNorm in train mode, an eval forward between steps (DDP's buffer rule)."""
    for step in range(3):
        loss_of(model, step, 0, rank).backward()
        opts[0].step()
        opts[0].zero_grad()
        if step == 1:
            with torch.no_grad():
                model(data(9, 9, rank)[0])


def two_optimizers(model: nn.Module) -> list[torch.optim.Optimizer]:
    assert isinstance(model, Net)
    rest = [p for n, p in model.named_parameters() if not n.startswith("a.")]
    return [Lion(model.a.parameters(), lr=0.01), torch.optim.SGD(rest, lr=0.1, momentum=0.9)]


def several_loop(model: Any, opts: list[Any], rank: int) -> None:
    for step in range(3):
        loss_of(model, step, 0, rank).backward()
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()


def scaler_loop(model: Any, opts: list[Any], rank: int) -> None:
    """torch's own GradScaler; the first step overflows and is skipped."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1)
    for step in range(4):
        scaler.scale(loss_of(model, step, 0, rank)).backward()
        scaler.unscale_(opts[0])
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opts[0])
        scaler.update()
        opts[0].zero_grad()


def join_loop(divide: bool) -> Loop:
    def loop(model: Any, opts: list[Any], rank: int) -> None:
        with model.join(divide_by_initial_world_size=divide):
            for step in range(4 if rank == 0 else 2):  # rank 1 runs out first
                loss_of(model, step, 0, rank).backward()
                opts[0].step()
                opts[0].zero_grad()

    return loop


def join_throw_check(rank: int) -> str:
    """join(throw_on_early_termination=True): every rank raises, naming rank 1."""
    base = Net(0)
    model, opt = gradhub.prepare(base, sgd(base)[0])
    with model:
        try:
            with model.join(throw_on_early_termination=True):
                for step in range(3 if rank == 0 else 1):
                    loss_of(model, step, 0, rank).backward()
                    opt.step()
                    opt.zero_grad()
        except gradhub.WorkerFailedError as exc:
            return str(exc)
    return "no error"


def powersgd_check(rank: int) -> bool:
    """torch's PowerSGD hook (collectives chained from its future's callbacks) runs,
    compressing from the second synchronising step, and the replicas stay equal.
    Not compared with DDP: DDP aborts in gloo with this hook on this model (a
    collective size mismatch, seen with find_unused_parameters=True on CPU)."""
    base = Net(0)
    model, opts = gradhub.prepare(base, adamw(base))
    state = powerSGD.PowerSGDState(
        process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
    )
    model.register_comm_hook(state, powerSGD.powerSGD_hook)
    with model:
        nanogpt_loop(model, opts, rank)
    mine = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
    other = mine.clone()
    dist.broadcast(other, src=0)
    return torch.equal(mine, other) and bool(torch.isfinite(mine).all())


def user_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """A hook written against DDP's GradBucket: checks the interface, averages."""
    buffer = bucket.buffer()
    grads, params = bucket.gradients(), bucket.parameters()
    assert len(grads) == len(params) and isinstance(bucket.index(), int)
    assert isinstance(bucket.is_last(), bool)
    assert sum(g.numel() for g in grads) == buffer.numel()
    assert all(g.shape == p.shape for g, p in zip(grads, params, strict=True))
    buffer.div_(dist.get_world_size())
    fut = dist.all_reduce(buffer, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def _bf16_for_ddp(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    return default_hooks.bf16_compress_hook(state, bucket)


# DDP refuses bf16_compress_hook by name off CUDA; gloo runs it.
BF16_HOOK = default_hooks.bf16_compress_hook
BF16_HOOK = type(
    "Bf16Hook", (), {"__call__": staticmethod(BF16_HOOK), "for_ddp": staticmethod(_bf16_for_ddp)}
)()


# the jobs ----------------------------------------------------------------------------


def ddp_checks(rank: int, world: int) -> dict[str, Any]:
    """Every check of the module; a check that raises reports its error as its value."""
    runtime = gradhub.init(timeout=60)
    bn = lambda: Net(10 + rank, bn=True, frozen=True)  # noqa: E731
    small = {"bucket_cap_mb": 0.0005}  # several buckets
    checks: dict[str, Callable[[], Any]] = {
        "nanogpt": lambda: both(rank, nanogpt_loop)["diff"],
        "repeated sync": lambda: both(rank, repeated_sync_loop)["diff"],
        "gradient_as_bucket_view": lambda: both(
            rank, repeated_sync_loop, ddp={"gradient_as_bucket_view": True}
        )["diff"],
        "forward decides": lambda: both(rank, forward_decides_loop)["diff"],
        "unused": lambda: unused_check(rank),
        "clip torch": lambda: both(rank, clip_loop("torch"))["diff"],
        "clip gradhub": lambda: both(rank, clip_loop("gradhub"))["diff"],
        "buffers": lambda: both(rank, buffers_loop, bn)["diff"],
        "buffers off": lambda: both(rank, buffers_loop, bn, ddp={"broadcast_buffers": False})[
            "diff"
        ],
        "several optimizers": lambda: both(rank, several_loop, optimizers=two_optimizers)["diff"],
        "scaler": lambda: both(rank, scaler_loop)["diff"],
        "bucket_cap_mb": lambda: both(rank, nanogpt_loop, ddp=small)["diff"],
        "clip gradhub, buckets": lambda: both(rank, clip_loop("gradhub"), ddp=small)["diff"],
        "allreduce_hook": lambda: both(rank, nanogpt_loop, hook=default_hooks.allreduce_hook)[
            "diff"
        ],
        "fp16_compress_hook": lambda: both(
            rank, nanogpt_loop, hook=default_hooks.fp16_compress_hook
        )["diff"],
        "bf16_compress_hook": lambda: both(rank, nanogpt_loop, hook=BF16_HOOK)["diff"],
        "user hook": lambda: both(rank, nanogpt_loop, hook=user_hook)["diff"],
        "powerSGD_hook": lambda: powersgd_check(rank),
        "join divide=True": lambda: both(rank, join_loop(True), optimizers=sgd)["diff"],
        "join divide=False": lambda: both(rank, join_loop(False), optimizers=sgd)["diff"],
        "join throw": lambda: join_throw_check(rank),
        "bf16": lambda: bf16_check(rank),
        "rank 0 alone": lambda: rank0_checkpoint(rank, runtime),
    }
    out: dict[str, Any] = {}
    try:
        for name, check in checks.items():
            try:
                out[name] = check()
            except Exception as exc:  # reported per check; later ones may still run
                out[name] = f"{type(exc).__name__}: {exc}"
        return out
    finally:
        runtime.close()


def unused_check(rank: int) -> dict[str, Any]:
    r = both(rank, unused_loop, ddp={"find_unused_parameters": True})
    return {
        "diff": r["diff"],
        "never grad": [r[k + " grads"]["never.weight"] for k in ("ddp", "gradhub")],
        "never moved": torch.equal(r["gradhub"]["never.weight"], Net(0).never.weight),
    }


def sgd(model: nn.Module) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)]


def bf16_check(rank: int) -> float:
    """bf16 parameters: the combined gradient is the fp32 sum of the widened,
    halved local gradients, rounded once to bf16."""
    base = Net(0).bfloat16()
    model, opt = gradhub.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1))
    with model:
        x, y = data(0, 0, rank)
        local = Net(0).bfloat16()
        nn.functional.cross_entropy(local(x.bfloat16()), y).backward()
        nn.functional.cross_entropy(model(x.bfloat16()), y).backward()
        worst = 0.0
        for (name, p), q in zip(base.named_parameters(), local.parameters(), strict=True):
            if q.grad is None:
                assert p.grad is None, name
                continue
            parts = [torch.zeros_like(q.grad) for _ in range(2)]
            dist.all_gather(parts, q.grad)
            want = (parts[0].float() * 0.5 + parts[1].float() * 0.5).bfloat16()
            assert p.grad is not None and p.grad.dtype == torch.bfloat16, name
            worst = max(worst, float((p.grad.float() - want.float()).abs().max()))
        opt.step()
    return worst


def rank0_checkpoint(rank: int, runtime: Any) -> dict[str, Any]:
    """Rank 0 alone calls state_dict(): nothing waits for rank 1; plain torch loads it."""
    base = Net(0)
    model, opt = gradhub.prepare(base, adamw(base)[0])
    with model:
        loss_of(model, 0, 0, rank).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        used = [p for n, p in base.named_parameters() if n.startswith(("a.", "b."))]
        zeros = all(p.grad is not None and not p.grad.any() for p in used)
        opt.zero_grad()
        nones = all(p.grad is None for p in base.parameters())
        seen: dict[str, Any] = {"zero_grad": (zeros, nones)}
        if rank == 0:
            start = time.monotonic()
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            seen["seconds"] = time.monotonic() - start
            buf.seek(0)
            saved = torch.load(buf)
            plain = Net(1)
            plain.load_state_dict(saved["model"])
            plain_opt = adamw(plain)[0]
            plain_opt.load_state_dict(saved["opt"])
            seen["loads"] = max_diff(state_of(plain), state_of(base)) == 0.0
        else:
            time.sleep(3.0)  # rank 0 must not need this rank meanwhile
        runtime.all_reduce_sum(torch.zeros(1), where="checkpoint written")
    return seen


def runs_out_without_join(rank: int, world: int) -> str:
    """Rank 1 stops after one step and stays alive (until rank 0 has its answer,
    however loaded the machine): rank 0's next step must fail within the
    timeout, naming rank 1."""
    answered = Path(tempfile.gettempdir()) / f"gradhub-runs-out-{os.environ['MASTER_PORT']}"
    runtime = gradhub.init(timeout=2)
    try:
        base = Net(0)
        model, opt = gradhub.prepare(base, adamw(base)[0])
        for step in range(2 if rank == 0 else 1):
            try:
                loss_of(model, step, 0, rank).backward()
            except gradhub.GradhubError as exc:
                answered.touch()
                return f"{type(exc).__name__}: {exc}"
            opt.step()
            opt.zero_grad()
        deadline = time.monotonic() + 40
        while not answered.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return "finished"
    finally:
        runtime.close()
        if rank == 1:
            answered.unlink(missing_ok=True)
