"""PowerSGD bucket reducer: error feedback, warm start, exact parts, same bits on every rank."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import gradhub
from gradhub.train.reducers.powersgd import PowerSGD, orthonormalize_
from gradhub.transports import choice as transport
from harness import run_ranks
from train_helpers import counting_backend_all_reduce


def _relative_error_of_mean(
    ps: PowerSGD, g: torch.Tensor, shapes: list[torch.Size], steps: int
) -> list[float]:
    """Reduce the same gradient ``steps`` times; relative error of the running mean after each."""
    acc = torch.zeros_like(g)
    out = []
    for t in range(steps):
        b = g.clone()
        ps.reduce(b, shapes=shapes, bucket_index=0, step=t)
        acc += b
        out.append(float((acc / (t + 1) - g).norm() / g.norm()))
    return out


@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(3, 12),
    cols=st.integers(3, 12),
    rank=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_error_feedback_makes_the_accumulated_update_converge(
    rows: int, cols: int, rank: int, seed: int
) -> None:
    assume((rows + cols) * rank < rows * cols)  # a matrix PowerSGD compresses
    shapes = [torch.Size([rows, cols]), torch.Size([cols])]
    g = torch.randn(rows * cols + cols + 1, generator=torch.Generator().manual_seed(seed))
    with_ef = _relative_error_of_mean(PowerSGD(rank=rank, min_compression_rate=1), g, shapes, 400)
    # With error feedback, sum of the updates = T * g - E_T and E_T stays
    # bounded, so the running mean's error falls like 1/T: 10x more steps,
    # several times smaller (the bound's constant depends on the spectrum).
    # (A floor of 1%: where rank r nearly captures the matrix the error is small
    # from the start and falls more slowly in relative terms.)
    assert with_ef[-1] < max(with_ef[39] / 3, 0.01)
    assert with_ef[-1] < 0.1
    without = _relative_error_of_mean(
        PowerSGD(rank=rank, min_compression_rate=1, error_feedback=False), g, shapes, 400
    )
    # Without it the mean is stuck at a rank-r approximation of g (the 1-D
    # tensor is exact either way, so the error is that of the matrix alone).
    if rank < min(rows, cols):
        assert without[-1] > 2 * with_ef[-1]


def test_warm_start_continues_the_power_iteration_from_the_last_q() -> None:
    # A fixed 40 x 30 gradient with singular values 8, 4, 2, 1, 0.5, ... and
    # rank 2: each step is one power iteration, so with warm start (Q of step
    # k + 1 = Q of step k) the approximation converges to the best rank-2 one
    # (error sqrt(2**2 + 1 + 0.5**2 + ...)); the subspace error shrinks about
    # 2x per step (sigma_3 / sigma_2). Without it every step restarts from the
    # same seeded Q and gives the same approximation, 16% worse than the best.
    g = torch.Generator().manual_seed(3)
    u, _ = torch.linalg.qr(torch.randn(40, 30, generator=g))
    v, _ = torch.linalg.qr(torch.randn(30, 30, generator=g))
    sigma = 8.0 * 0.5 ** torch.arange(30.0)
    matrix = u @ torch.diag(sigma) @ v.t()
    best = float(sigma[2:].norm())
    shapes = [torch.Size([40, 30])]

    def errors(warm_start: bool) -> list[float]:
        ps = PowerSGD(rank=2, error_feedback=False, warm_start=warm_start)
        out = []
        for step in range(5):
            b = matrix.reshape(-1).clone()
            ps.reduce(b, shapes=shapes, bucket_index=0, step=step)
            out.append(float((b.view(40, 30) - matrix).norm()))
        return out

    warm, cold = errors(True), errors(False)
    assert warm[0] == cold[0] > 1.1 * best  # the same seeded start, far from the best
    assert warm[-1] < 1.001 * best  # converged over the steps
    assert cold == [cold[0]] * len(cold)  # restarted every step


def test_small_tensors_trailing_elements_and_early_steps_are_exact() -> None:
    shapes = [torch.Size([16, 12]), torch.Size([12]), torch.Size([2, 2])]
    g = torch.randn(16 * 12 + 12 + 4 + 1)
    ps = PowerSGD(rank=1, start_step=2)
    for step in range(4):
        b = g.clone()
        ps.reduce(b, shapes=shapes, bucket_index=3, step=step)
        if step < 2:
            assert torch.equal(b, g)  # full-precision steps: a world of one changes nothing
        else:
            assert not torch.equal(b[: 16 * 12], g[: 16 * 12])  # compressed
            # the 1-D tensor, the 2x2 one (not worth compressing) and the trailing count
            assert torch.equal(b[16 * 12 :], g[16 * 12 :])
    with pytest.raises(ValueError, match="changed its layout"):
        ps.reduce(g.clone(), shapes=shapes[:1], bucket_index=3, step=5)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="rank must be an integer >= 1"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match="start_step must be >= 0"):
        PowerSGD(start_step=-1)
    with pytest.raises(ValueError, match="more than the bucket"):
        PowerSGD().reduce(torch.zeros(3), shapes=[torch.Size([2, 2])], bucket_index=0, step=0)


def test_orthonormalize_keeps_zero_columns_zero() -> None:
    p = torch.tensor([[3.0, 0.0, 1.0], [4.0, 0.0, 1.0]])
    orthonormalize_(p)
    assert torch.equal(p[:, 1], torch.zeros(2))
    assert math.isclose(float(p[:, 0].norm()), 1.0, rel_tol=1e-6)
    assert abs(float(p[:, 0] @ p[:, 2])) < 1e-6


SHAPES = [torch.Size([24, 16]), torch.Size([16]), torch.Size([8, 24])]
SIZE = sum(s.numel() for s in SHAPES) + 1  # + a trailing sample count


def _gradient(rank: int, step: int) -> torch.Tensor:
    return torch.randn(SIZE, generator=torch.Generator().manual_seed(100 * rank + step))


def _reductions(rank: int, ps: PowerSGD, *, fixed_steps: int = 100) -> list[np.ndarray]:
    out = []
    for step in range(5):
        b = _gradient(rank, step)
        ps.reduce(b, shapes=SHAPES, bucket_index=0, step=step)
        out.append(b.numpy().copy())  # tensors do not outlive their process in a queue
    if not fixed_steps:
        return out
    # A fixed gradient per rank, reduced again and again (bucket 1): the running
    # mean of the results must approach the true sum (error feedback across ranks).
    fixed = _gradient(rank, 99)
    acc = torch.zeros(SIZE)
    for step in range(fixed_steps):
        b = fixed.clone()
        ps.reduce(b, shapes=SHAPES, bucket_index=1, step=step)
        acc += b
    out.append((acc / fixed_steps).numpy())
    return out


def _ranks_reduce(rank: int, world_size: int) -> dict[str, Any]:
    """The reductions through the job's group (its transport: shared memory here),
    the first 5 again through gloo's own all_reduce, counting what reached gloo's."""
    with gradhub.init(timeout=30) as runtime:
        with counting_backend_all_reduce() as on_group:
            group = _reductions(rank, PowerSGD(rank=2, start_step=1, collective=runtime.group))
        with counting_backend_all_reduce() as on_gloo:
            gloo = _reductions(rank, PowerSGD(rank=2, start_step=1), fixed_steps=0)
        return {
            "group": group,
            "gloo": gloo,
            "calls": (sum(on_group.values()), sum(on_gloo.values())),
            "transport": transport.chosen(runtime.group),
        }


@pytest.mark.slow
def test_every_rank_ends_with_the_same_bits() -> None:
    ranks = run_ranks(_ranks_reduce, 2, timeout=90)
    for r in ranks:
        # Through the group nothing reached gloo's all_reduce (shared memory ran
        # them); the fallback ran 1 per full-precision step, 2 per compressed one.
        assert r.value["transport"] == "shm"
        assert r.value["calls"] == (0, 1 + 4 * 2)
    results = [[torch.from_numpy(a) for a in r.value["group"]] for r in ranks]
    # The fallback: the same bits on every rank, and those of the group (two
    # ranks: every all-reduce is one fp32 addition, which commutes).
    for r in ranks:
        for step, value in enumerate(r.value["gloo"]):
            assert torch.equal(torch.from_numpy(value), results[0][step]), f"step {step}"
    for step in range(5):
        assert torch.equal(results[0][step], results[1][step]), f"step {step}"
    total = [_gradient(0, s) + _gradient(1, s) for s in range(5)]
    # Step 0 is full precision: the sum of two fp32 numbers, exact.
    assert torch.equal(results[0][0], total[0])
    # Step 1 is the first compressed one; no error is carried yet, so the
    # result is PowerSGD of the summed gradient (P and Q are sums of the
    # ranks' products: float reordering only).
    alone = total[1].clone()
    PowerSGD(rank=2).reduce(alone, shapes=SHAPES, bucket_index=0, step=0)
    torch.testing.assert_close(results[0][1], alone, rtol=1e-5, atol=1e-5)
    total_fixed = _gradient(0, 99) + _gradient(1, 99)
    error = float((results[0][5] - total_fixed).norm() / total_fixed.norm())
    # Errors that add up to what each result left out: after 100 steps the mean
    # is within a few percent of the sum (without it, ~70% off; with errors of
    # the wrong scale it diverges).
    assert error < 0.1, error
    # 1-D tensor and the trailing count are reduced exactly on every step.
    start = 24 * 16
    for step in range(5):
        assert torch.equal(results[0][step][start : start + 16], total[step][start : start + 16])
        assert torch.equal(results[0][step][-1:], total[step][-1:])


def _digits_accuracy(rank: int, world_size: int) -> dict[str, float]:
    """The digits MLP of examples/train_digits.py, fp32 then PowerSGD, 2 ranks each."""
    from sklearn.datasets import load_digits

    runtime = gradhub.init(timeout=60)
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    accuracy = {}
    for name, options in {
        "fp32": {},
        "powersgd": {"compress": "powersgd", "compress_options": {"rank": 4}},
    }.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        with gradhub.DataParallelTrainer(
            model, optimizer, strategy="allreduce", runtime=runtime, **options
        ) as trainer:
            result = trainer.fit(
                (x[train], y[train]),
                eval_data=(x[test], y[test]),
                epochs=10,
                batch_size=64,
                progress=False,
            )
        accuracy[name] = float(result.eval_accuracy or 0.0)
    runtime.close()
    return accuracy


def test_digits_with_powersgd_is_within_half_a_point_of_fp32() -> None:
    results = run_ranks(_digits_accuracy, 2, timeout=300)
    acc = results[0].value
    assert acc["fp32"] >= 0.95
    # 360 test images: half a point is 1.8 images.
    assert abs(acc["powersgd"] - acc["fp32"]) <= 0.005, acc
