"""The ranks of the GPU tests (``tests/gpu/``), run by ``tests/harness.py``.

Every job returns plain Python values (parameters as NumPy arrays, error
texts), so a failure on a rank comes back as its traceback. Models and data
are small: the suite must stay under five minutes on one GPU.
"""

from __future__ import annotations

import importlib
import sys
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradhub
from gradhub.collective import AllReduceParameter, all_gather, all_reduce, reduce_scatter
from gradhub.transports import chosen

STEPS = 4
STRATEGIES = ["allreduce", "sharded", "ps-async", "ps-sync", "ps-ssp"]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def batch(step: int, rank: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s part of step ``step`` (on the CPU; the job moves it)."""
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    parts = [batch(step, r) for r in range(world)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def params(model: nn.Module) -> list[np.ndarray]:
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def loop(model: Any, opt: Any, data: list[tuple[torch.Tensor, torch.Tensor]], device: Any) -> None:
    """The plain loop: zero_grad, forward, backward, step."""
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()


def plain(device: torch.device, world: int = 1) -> list[np.ndarray]:
    """Plain training on the global batches: the reference."""
    model = mlp().to(device)
    loop(model, sgd(model), [global_batch(s, world) for s in range(STEPS)], device)
    return params(model)


def strategies_job(
    rank: int, world: int, servers: dict[str, str], backend: str | None
) -> dict[str, Any]:
    """Every strategy through ``gradhub.prepare`` on this rank's GPU."""
    with gradhub.init(backend=backend, timeout=60) as runtime:
        device = runtime.device
        out: dict[str, Any] = {"backend": runtime.backend, "device": str(device)}
        out["plain"] = plain(device, world)
        for strategy in STRATEGIES:
            if strategy.startswith("ps-") and strategy not in servers:
                continue
            model = mlp().to(device)
            options = {"servers": [servers[strategy]]} if strategy in servers else {}
            prepared, opt = gradhub.prepare(
                model, sgd(model), strategy=strategy, runtime=runtime, **options
            )
            loop(prepared, opt, [batch(s, rank) for s in range(STEPS)], device)
            prepared.strategy.refresh()
            out[strategy] = params(model)
            out[f"{strategy}/device"] = str(next(model.parameters()).device)
            prepared.close()
    return out


def no_sync_job(rank: int, world: int, strategy: str) -> str:
    """One steady-state step under ``set_sync_debug_mode("error")``: ``"no sync"``,
    or the error and where it came from."""
    with gradhub.init(timeout=60) as runtime:
        device = runtime.device
        model = mlp().to(device)
        prepared, opt = gradhub.prepare(model, sgd(model), strategy=strategy, runtime=runtime)
        x, y = (t.to(device) for t in batch(0, rank))

        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(prepared(x), y).backward()
            opt.step()

        for _ in range(3):  # warm-up: buckets, allocations, the transport's choice
            step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        except RuntimeError:
            return traceback.format_exc()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        prepared.close()
    return "no sync"


def staged_collectives_job(rank: int, world: int) -> dict[str, Any]:
    """The collectives on CUDA tensors of a gloo group (staged through host
    memory) beside the same calls on CPU tensors: the same bits."""
    torch.manual_seed(rank)
    with gradhub.init(backend="gloo", timeout=60) as runtime:
        group, gpu = runtime.group, runtime.local_device("cuda")
        out: dict[str, Any] = {"backend": runtime.backend, "transport": None}
        for size in (7, 1000, 3_000_001):  # the collective path and the ring's
            x = torch.randn(size)
            for device in ("cpu", gpu):
                here = x.to(device)
                summed = all_reduce(here.clone(), group=group).wait()
                mine = reduce_scatter(here, group=group, compress="bf16")
                whole = all_gather(mine, size, group=group, compress="bf16")
                out[(size, str(device))] = [t.cpu().numpy() for t in (summed, mine, whole)]
                out[(size, str(device), "devices")] = {t.device.type for t in (summed, whole)}
        out["transport"] = chosen(group)
        # A tensor made and read on a stream of the script's own: the copies
        # wait for its producer and the stream waits for the result.
        side = torch.cuda.Stream(gpu)
        with torch.cuda.stream(side):
            a = torch.rand(2048, 2048, device=gpu) / 2048
            x = (a @ a @ a).sum(0) * 0 + (rank + 1)  # a slow producer of known values
            all_reduce(x, group=group).wait()
            read = (x * 1).cpu()
        out["stream"] = read.unique().tolist()
        # AllReduceParameter with its buffers on the GPU (the sharded strategy's).
        arp = AllReduceParameter(1000, group=group, device=gpu)
        arp.init(torch.arange(1000.0, device=gpu))
        arp.put_gradients(torch.full((1000,), float(rank + 1), device=gpu))
        gradient = arp.aggregate_gradient_partition(world)
        weights = arp.get_weights(torch.zeros(1000, device=gpu)).wait()
        out["arp"] = (gradient.device.type, gradient.cpu().unique().tolist(), weights.cpu().numpy())
        arp.close()
    return out


def two_on_one_gpu_job(rank: int, world: int, strategy: str) -> dict[str, Any]:
    """Two ranks on one GPU over gloo: a CUDA model trained with ``strategy``."""
    with gradhub.init(backend="gloo", timeout=60) as runtime:
        device = runtime.local_device("cuda")
        model = mlp().to(device)
        prepared, opt = gradhub.prepare(model, sgd(model), strategy=strategy, runtime=runtime)
        loop(prepared, opt, [batch(s, rank) for s in range(STEPS)], device)
        gradhub.check_in_sync(prepared)
        out = {"params": params(model), "device": str(next(model.parameters()).device)}
        prepared.close()
    return out


def gradhub_backend_job(rank: int, world: int) -> dict[str, str]:
    """The "gradhub" backend (CPU tensors only) given CUDA tensors and a CUDA model."""
    out: dict[str, str] = {"backend": "taken"}
    dist.init_process_group("gradhub")  # env:// from the harness
    try:
        dist.all_reduce(torch.ones(2, device="cuda"))
    except Exception as exc:  # the backend's error, as torch hands it on
        out["backend"] = f"{type(exc).__name__}: {exc}"
    with gradhub.init() as runtime:  # adopts the group
        out["prepare"] = _refusal(lambda: mlp().cuda(), runtime)
    dist.destroy_process_group()
    return out


def nccl_alone_job(rank: int, world: int) -> dict[str, str]:
    """NCCL alone given a CPU model, or a model on another GPU than the rank's."""
    out: dict[str, str] = {}
    with gradhub.init(backend="nccl", timeout=60) as runtime:
        out["cpu model"] = _refusal(mlp, runtime)
        if torch.cuda.device_count() > 1:
            other = (runtime.device.index + 1) % torch.cuda.device_count()
            out["another gpu"] = _refusal(lambda: mlp().to(f"cuda:{other}"), runtime)
    return out


def _refusal(make: Callable[[], nn.Module], runtime: gradhub.Runtime) -> str:
    model = make()
    try:
        gradhub.prepare(model, sgd(model), runtime=runtime)
    except gradhub.GradhubError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "taken"


def ddp_beside_job(rank: int, world: int) -> dict[str, Any]:
    """Two GPUs: gradhub's strategies beside DDP on NCCL in the same processes."""
    with gradhub.init(timeout=60) as runtime:
        device = runtime.device
        data = [batch(s, rank) for s in range(STEPS)]
        ddp_model = mlp().to(device)
        ddp = nn.parallel.DistributedDataParallel(ddp_model)
        loop(ddp, sgd(ddp), data, device)
        out: dict[str, Any] = {"ddp": params(ddp_model), "backend": runtime.backend}
        for strategy in ("allreduce", "sharded"):
            model = mlp().to(device)
            prepared, opt = gradhub.prepare(model, sgd(model), strategy=strategy, runtime=runtime)
            loop(prepared, opt, data, device)
            out[strategy] = params(model)
            prepared.close()
        cpu = all_reduce(torch.ones(8), group=runtime.group).wait()
        out["cpu"] = (cpu.tolist(), chosen(runtime.group))
        cuda = all_reduce(torch.ones(8, device=device), group=runtime.group).wait()
        out["cuda"] = (cuda.cpu().tolist(), runtime.group.device_transport.name)
        # Made on a stream of the script's own while an operation is queued (so
        # this one runs on the worker thread): NCCL follows the slow producer.
        side = torch.cuda.Stream(device)
        with torch.cuda.stream(side):
            queued = all_reduce(torch.ones(1 << 20, device=device), group=runtime.group)
            x = torch.zeros(8, device=device)
            torch.cuda._sleep(200_000_000)  # the producer is late on the device
            x += rank + 1  # known values
            late = all_reduce(x, group=runtime.group)
            queued.wait()
            out["stream"] = (late.wait() * 1).cpu().unique().tolist()
    return out


def examples_job(rank: int, world: int, examples: str, tmp: str) -> dict[str, Any]:
    """The examples with ``--device cuda`` in this rank: the own-loop port and
    the ``fit`` language model (two strategies each; losses first and last),
    then, in a job of one, the two ported scripts (which set up and destroy
    the process group themselves)."""
    sys.path.insert(0, examples)
    ddp_port, charlm = importlib.import_module("ddp_port"), importlib.import_module("charlm")
    out: dict[str, Any] = {}
    with gradhub.init(timeout=60) as runtime:  # the examples' own init() adopts it
        out["backend"] = runtime.backend
        for strategy in ("allreduce", "sharded"):
            common = ["--strategy", strategy, "--device", "cuda", "--epochs", "2"]
            port = ddp_port.main([*common, "--samples", "256"])
            small = ["--sentences", "300", "--length", "32", "--width", "64", "--layers", "2"]
            lm = charlm.main([*common, *small, "--batch-size", "16"])
            out[strategy] = (port["first"], port["last"], lm["first"], lm["last"])
    if world == 1:
        nanogpt = importlib.import_module("nanogpt_port")
        tutorial = importlib.import_module("ddp_tutorial")
        short = ["--max_iters", "10", "--eval_interval", "5", "--out_dir", f"{tmp}/nanogpt"]
        run = nanogpt.main(["--device", "cuda", *short])
        out["nanogpt"] = run["val"]
        epochs = tutorial.main(["2", "1", "--device", "cuda", "--snapshot_path", f"{tmp}/s.pt"])
        out["tutorial"] = epochs["val"]
    return out
