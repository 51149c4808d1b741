"""``precision="fp16"`` and ``gradhub.GradScaler``: dynamic loss scaling whose
skipped steps are agreed across the ranks that share them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gradhub
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.consistency import Consistency
from gradhub.ps.server.launch import start_server
from gradhub.train.strategies import make_strategy
from harness import run_ranks

STRATEGIES = ("allreduce", "sharded", "ps-sync", "ps-async", "ps-ssp")
AGREED = ("allreduce", "sharded", "ps-sync")  # ranks whose updates depend on each other
BATCH, STEPS, POISONED = 4, 8, 2  # global batch, steps of the fit job, steps poisoned on rank 1


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def data(n: int = BATCH * STEPS) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long() + (x[:, 2] > 1).long()


def poisoned() -> torch.Tensor:
    """The inputs with rank 1's samples of the first ``POISONED`` steps at 1e30:
    beyond fp16's range, so rank 1's forward (and gradient) overflows there and
    rank 0's does not (``fit`` splits a global batch round-robin: odd positions
    go to rank 1)."""
    x = data()[0].clone()
    for step in range(POISONED):
        x[step * BATCH + 1 : (step + 1) * BATCH : 2] = 1e30
    return x


def flat(model: nn.Module) -> np.ndarray:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


# --- fit(precision="fp16") under every strategy ------------------------------------------


def every_job(rank: int, world: int, servers: dict[str, str]) -> dict[str, Any]:
    """All multi-process checks of this file in one job (one start of 2 processes)."""
    with gradhub.init(timeout=30) as runtime:
        out = {name: _fit_one(name, runtime, servers) for name in STRATEGIES}
        out["reference"] = _own_loop(rank, world, runtime)
        out["powersgd"] = _own_loop(rank, world, runtime, compress="powersgd")
        out["wire"] = {c: _wire_overflow(rank, runtime, c) for c in ("allreduce", "sharded")}
        return out


def _fit_one(name: str, runtime: Any, servers: dict[str, str]) -> dict[str, Any]:
    x, y = data()
    options = {"servers": [servers[name]], "timeout": 30} if name in servers else {}
    strategy = make_strategy(name, **options)
    model = mlp()
    with torch.no_grad():
        before = float(F.cross_entropy(model(x), y))
    records: list[dict[str, Any]] = []
    params: list[np.ndarray] = []

    def on_step(step: int, record: dict[str, Any]) -> None:
        records.append(dict(record))
        params.append(flat(model))

    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    with gradhub.DataParallelTrainer(model, opt, strategy=strategy, runtime=runtime) as trainer:
        trainer.fit(
            (poisoned(), y),
            batch_size=BATCH,
            shuffle=False,
            precision="fp16",
            grad_clip=10.0,
            progress=False,
            on_step=on_step,
        )
        dist.barrier()  # every push is in: the servers' values are final
        strategy.refresh()
        gradhub.check_in_sync(model, runtime)  # raises naming the ranks that differ
        with torch.no_grad():
            after = float(F.cross_entropy(model(x), y))
    return {
        "losses": (before, after),
        "skipped": [r["skipped"] for r in records],
        "scales": [r["loss_scale"] for r in records],
        "params": params,
        "initial": flat(mlp()),
        "skipped_steps": strategy.skipped_steps,
        "steps": strategy.steps,
    }


@pytest.fixture(scope="module")
def results() -> Iterator[list[Any]]:
    with (
        start_server(ServerConfig(mode="sync", workers=2), in_thread=True) as sync,
        start_server(ServerConfig(mode="async", workers=2), in_thread=True) as asyn,
        # max_staleness=0: a worker one push ahead waits, so a skip that did not
        # move the skipping worker's clock would stall the other one's pulls.
        start_server(ServerConfig(mode="ssp", workers=2, max_staleness=0), in_thread=True) as ssp,
    ):
        servers = {"ps-sync": sync.address, "ps-async": asyn.address, "ps-ssp": ssp.address}
        yield [r.value for r in run_ranks(every_job, 2, servers, timeout=150)]


@pytest.mark.parametrize("name", STRATEGIES)
def test_fit_fp16_trains_and_keeps_replicas_equal(results: list[Any], name: str) -> None:
    for rank in (0, 1):
        run = results[rank][name]
        before, after = run["losses"]
        assert after < 0.9 * before, (rank, run["losses"])
        assert run["steps"] == STEPS  # a skipped step counts as a step
    # (check_in_sync in the job raised if the replicas differed.)


@pytest.mark.parametrize("name", AGREED)
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(
    results: list[Any], name: str
) -> None:
    zero, one = results[0][name], results[1][name]
    # Only rank 1's data overflowed; rank 0 skipped the same steps.
    assert zero["skipped"] == one["skipped"] == [True] * POISONED + [False] * (STEPS - POISONED)
    assert zero["skipped_steps"] == one["skipped_steps"] == POISONED
    # The scale a step used halves after each skip, then holds (growth_interval 2000).
    want = [2.0**16 / 2 ** min(i, POISONED) for i in range(STEPS)]
    assert zero["scales"] == one["scales"] == want
    # The skipped steps left the parameters as they were; the next one changed them.
    for i in range(POISONED):
        assert np.array_equal(zero["params"][i], zero["initial"]), i
    assert not np.array_equal(zero["params"][POISONED], zero["initial"])


@pytest.mark.parametrize("name", ["ps-async", "ps-ssp"])
def test_asynchronous_workers_skip_on_their_own(results: list[Any], name: str) -> None:
    zero, one = results[0][name], results[1][name]
    assert zero["skipped_steps"] == 0 and not any(zero["skipped"])
    assert one["skipped"] == [True] * POISONED + [False] * (STEPS - POISONED)
    assert zero["scales"] == [2.0**16] * STEPS
    # ps-ssp with max_staleness=0: rank 0 never waited on a clock that rank 1's
    # skips did not move (else the job would have timed out).


# --- own loop: torch's GradScaler as the reference, fp16 wire overflow ----------------------

REF_STEPS = 6
REF_OPTIONS = {"init_scale": 2.0**40, "backoff_factor": 2.0**-10}
# The scales tried are 2**40, 2**30, 2**20, 2**10: the first three overflow fp16
# by a wide margin, the last fits it by a wide margin. Under allreduce each rank's
# fp16 backward sees the gradient of its own half's mean (DDP averages after
# backward), up to twice the whole batch's: scales this far apart make the
# overflow decision the same as the single process's on the whole batch.


def _own_loop(rank: int, world: int, runtime: Any, **options: Any) -> dict[str, Any]:
    """``allreduce``, each rank on its half of every global batch."""
    x, y = data(BATCH * REF_STEPS)
    base = mlp()
    model, opt = gradhub.prepare(
        base, torch.optim.SGD(base.parameters(), lr=0.1), runtime=runtime, **options
    )
    scaler = gradhub.GradScaler(opt, **REF_OPTIONS)
    scales, params = [], []
    with opt:
        for step in range(REF_STEPS):
            rows = slice(step * BATCH + rank, (step + 1) * BATCH, world)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x[rows]).float(), y[rows])
            scaler.scale(loss).backward()
            scaler.step(opt)
            scales.append(scaler.get_scale())
            scaler.update()
            params.append(flat(base))
    return {"scales": scales, "params": params, "state": scaler.state_dict()}


def _wire_overflow(rank: int, runtime: Any, strategy: str) -> dict[str, Any]:
    """fp32 backward (no autocast) with compress="fp16": the scaled gradient is
    finite locally but beyond fp16's range on the wire."""
    x, y = data(BATCH)
    base = mlp()
    model, opt = gradhub.prepare(
        base,
        torch.optim.SGD(base.parameters(), lr=0.1),
        strategy=strategy,
        runtime=runtime,
        compress="fp16",
    )
    scaler = gradhub.GradScaler(opt, init_scale=2.0**24, backoff_factor=2.0**-4)
    start = flat(base)
    # This rank's unscaled gradient, from a plain copy (the parameters stay put while
    # steps are skipped); on the wire it is scaled and weighted by 1/2 (the mean).
    copy = mlp()
    copy.load_state_dict(base.state_dict())
    grads = torch.autograd.grad(
        F.cross_entropy(copy(x[rank::2]), y[rank::2]), list(copy.parameters())
    )
    local = max(float(g.abs().max()) for g in grads) / 2
    skipped, largest = [], []
    with opt:
        for _ in range(4):
            opt.zero_grad()
            loss = F.cross_entropy(model(x[rank::2]), y[rank::2])
            largest.append(local * scaler.get_scale())
            scaler.scale(loss).backward()
            before = flat(base)
            scaler.step(opt)
            skipped.append(bool(np.array_equal(before, flat(base))))
            scaler.update()
            if not skipped[-1]:
                break
        gradhub.check_in_sync(model)
    return {"skipped": skipped, "largest": largest, "start": start, "end": flat(base)}


def torch_reference() -> dict[str, Any]:
    """One process, the whole batch, ``torch.amp.GradScaler`` and CPU fp16 autocast."""
    x, y = data(BATCH * REF_STEPS)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", **REF_OPTIONS)
    scales, params = [], []
    for step in range(REF_STEPS):
        rows = slice(step * BATCH, (step + 1) * BATCH)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x[rows]).float(), y[rows])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scales.append(scaler.get_scale())
        scaler.update()
        params.append(flat(model))
    return {"scales": scales, "params": params, "state": scaler.state_dict()}


def test_allreduce_matches_torch_grad_scaler_on_the_whole_batch(
    results: list[Any],
) -> None:
    want = torch_reference()
    initial = flat(mlp())
    for rank in (0, 1):
        got = results[rank]["reference"]
        # The same scales step by step: 3 skipped steps, then 2**10 to the end.
        assert got["scales"] == want["scales"] == [2.0**40, 2.0**30, 2.0**20] + [2.0**10] * 3
        assert got["state"] == want["state"]
        for i in range(3):  # skipped: the parameters as they were, in both runs
            assert np.array_equal(got["params"][i], initial)
            assert np.array_equal(want["params"][i], initial)
        # Then the same training up to fp16 rounding: the two runs round different
        # fp16 sums (each rank's half vs the whole batch; relative error 2**-11
        # of gradients of order 1, times lr 0.1, over 3 steps: about 1e-4).
        for a, b in zip(got["params"], want["params"], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-3)
        assert not np.array_equal(got["params"][-1], initial)


def test_powersgd_state_survives_a_skipped_step(results: list[Any]) -> None:
    """The skipped steps' inf would stay in PowerSGD's error feedback and warm
    start and make every later step overflow: they are dropped instead."""
    for rank in (0, 1):
        got = results[rank]["powersgd"]
        assert got["scales"] == [2.0**40, 2.0**30, 2.0**20] + [2.0**10] * 3
        assert np.isfinite(got["params"][-1]).all()
        assert not np.array_equal(got["params"][-1], got["params"][2])


@pytest.mark.parametrize("strategy", ["allreduce", "sharded"])
def test_an_fp16_wire_overflow_is_found_inf_not_a_saturated_value(
    results: list[Any], strategy: str
) -> None:
    zero, one = (results[r]["wire"][strategy] for r in (0, 1))
    assert zero["skipped"] == one["skipped"]  # agreed
    # 2**24 and 2**20 put values beyond 65504 on the wire: skipped, never applied
    # saturated (the fp16 codec would clamp them to 65504); at 2**16 every value,
    # and the sum of the two ranks' values, fits: the step is taken.
    assert zero["skipped"] == [True, True, False]
    for run in (zero, one):
        assert run["largest"][0] > run["largest"][1] > 65504 > 2 * run["largest"][2]
    assert not np.array_equal(zero["end"], zero["start"])


# --- misuse -------------------------------------------------------------------------------


def test_misuse_gives_clear_errors() -> None:
    base = mlp()
    plain = torch.optim.SGD(base.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"(?s)the optimizer gradhub.prepare returned.*SGD"):
        gradhub.GradScaler(plain)  # type: ignore[arg-type]
    with gradhub.init(timeout=10) as runtime:
        model, opt = gradhub.prepare(base, plain, runtime=runtime)
        with opt:
            with pytest.raises(ValueError, match="backoff_factor"):
                gradhub.GradScaler(opt, backoff_factor=2.0)
            scaler = gradhub.GradScaler(opt)
            with pytest.raises(gradhub.MisuseError, match="without a backward"):
                scaler.step(opt)
            x, y = data(BATCH)
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            scaler.unscale_(opt)
            with pytest.raises(gradhub.MisuseError, match="already called"):
                scaler.unscale_(opt)
            with pytest.raises(gradhub.MisuseError, match="without step"):
                scaler.update()
            scaler.step(opt)
            scaler.update()
            assert scaler.get_scale() == 2.0**16
            trainer = gradhub.DataParallelTrainer(model.module, plain, runtime=runtime)
            with pytest.raises(ValueError, match="precision='fp16' only"):
                trainer.fit((x, y), precision="bf16", grad_scaler={"init_scale": 8.0})
            with pytest.raises(
                ValueError, match=r"(?s)unknown grad_scaler option.*valid options are init_scale"
            ):
                trainer.fit((x, y), precision="fp16", grad_scaler={"scale": 8.0})


def test_fit_fp16_checkpoints_and_resumes_the_scale(tmp_path: Path) -> None:
    x, y = data()  # 32 samples, batches of 8: 4 steps per epoch
    scales: list[float] = []
    model = mlp()
    with gradhub.init(timeout=10) as runtime:
        trainer = gradhub.DataParallelTrainer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), runtime=runtime
        )
        settings: dict[str, Any] = {
            "batch_size": 8,
            "shuffle": False,
            "precision": "fp16",
            "grad_scaler": dict(REF_OPTIONS),
            "checkpoint_dir": tmp_path,
            "progress": False,
            "on_step": lambda step, record: scales.append(record["loss_scale"]),
            # Stepped after the first, skipped step: torch would warn that the
            # scheduler stepped before the optimizer (an error under -W error).
            "lr_scheduler": lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5),
        }
        with trainer:
            trainer.fit((x, y), epochs=1, **settings)
            first = list(scales)
            scales.clear()
            trainer.fit((x, y), epochs=2, resume=True, **settings)
    assert first == [2.0**40, 2.0**30, 2.0**20, 2.0**10]  # three skipped steps
    assert scales == [2.0**10] * 4  # the scale came back from the checkpoint
    assert trainer.optimizer.param_groups[0]["lr"] == 0.1 * 0.5**4  # 8 steps, skipped ones too


def test_skip_pushes_move_the_clock_and_apply_nothing() -> None:
    g = torch.ones(3)
    ssp = Consistency("ssp", workers=2, max_staleness=0)
    sync = Consistency("sync", workers=2)
    for c in (ssp, sync):
        for worker in (0, 1):
            c.seen(worker, pushing=True, now=0.0)  # as the server does before a push
    assert ssp.push(0, "w", g) == [g]
    assert ssp.push(1, "w", g, skip=True) == []  # nothing to apply...
    assert ssp.steps["w"] == {0: 1, 1: 1}  # ...but worker 1 is at step 1
    assert ssp.pull_ready(0, "w")
    assert sync.push(0, "w", g) == []
    (total,) = sync.push(1, "w", torch.full((3,), 5.0), skip=True)  # joins as zeros
    assert torch.equal(total, g)


def test_grad_scaler_state_dict_is_torchs() -> None:
    base = mlp()
    with gradhub.init(timeout=10) as runtime:
        _, opt = gradhub.prepare(base, torch.optim.SGD(base.parameters(), lr=0.1), runtime=runtime)
        with opt:
            ours = gradhub.GradScaler(opt, init_scale=8.0, growth_interval=7)
            theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=7)
            assert ours.state_dict() == theirs.state_dict()
            theirs.load_state_dict({**ours.state_dict(), "scale": 4.0})
            ours.load_state_dict(theirs.state_dict())
            assert ours.get_scale() == 4.0
            assert gradhub.GradScaler(opt, enabled=False).get_scale() == 1.0
