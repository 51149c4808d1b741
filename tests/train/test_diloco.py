"""The ``diloco`` strategy: inner steps on each worker, an outer step at every sync.

References: ``allreduce`` (H = 1 is a synchronous step), and DiLoCo written
out by hand in one process (``diloco_jobs.by_hand``: plain models and inner
optimizers, the pseudo-gradients weighted and averaged, Nesterov SGD on the
shared weights), which performs the same float32 operations in the same
order as the strategy, so it is compared bit for bit (computed in the
process it is compared with: torch's kernels round by their thread count).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradhub
from diloco_jobs import (
    by_hand,
    h1_against_allreduce,
    loop,
    loss_scalers,
    mlp,
    resumed,
    sgd_momentum,
    weighted_and_quiet,
)
from gradhub.errors import InvalidOptionError, UnsupportedOptionError
from gradhub.train.strategies.diloco import DiLoCoStrategy
from harness import run_ranks

STEPS = 5
EPS = float(np.finfo(np.float32).eps)


def _same(got: list[np.ndarray], want: list[np.ndarray], atol: float = 0.0) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if atol == 0.0:
            assert np.array_equal(g, w), f"tensor {i}: max diff {np.abs(g - w).max():.3g}"
        else:
            np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=f"tensor {i}")


@pytest.mark.slow
def test_one_inner_step_with_outer_sgd_lr_1_is_allreduce() -> None:
    """H = 1, SGD (lr a) inside, outer SGD lr 1 without momentum: ``allreduce``
    with SGD (lr a). Not bit for bit: DiLoCo takes the update as a difference of
    weights, ``p - (p - a g)``, which rounds to ``p``'s ulp, where allreduce
    multiplies ``a * mean(g)``; each step may differ by a few ulps of the
    largest weight (2 seen in 5 steps), so the bound is 4 ulps of it per step."""
    ranks = run_ranks(h1_against_allreduce, 2, STEPS, timeout=60)
    for r in ranks:
        allreduce, diloco = r.value["allreduce"], r.value["diloco"]
        largest = max(float(np.abs(a).max()) for a in allreduce)
        _same(diloco, allreduce, atol=4 * STEPS * EPS * largest)
    _same(ranks[1].value["diloco"], ranks[0].value["diloco"])  # replicas equal


def test_one_worker_is_inner_steps_then_the_outer_step_by_hand() -> None:
    """World 1, H = 3, SGD with momentum inside, the default outer optimizer (SGD,
    lr 0.7, Nesterov momentum 0.9) over two syncs and two inner steps after:
    the hand-written outer step bit for bit, the inner momentum kept across syncs."""
    steps, h = 8, 3
    want, want_shared = by_hand(1, steps, h, sgd_momentum)
    with gradhub.init(timeout=10) as runtime:
        base = mlp()
        model, opt = gradhub.prepare(
            base, sgd_momentum(base), strategy="diloco", runtime=runtime, inner_steps=h
        )
        loop(model, opt, 0, range(steps))
        strategy = model.strategy
        assert isinstance(strategy, DiLoCoStrategy)
        assert strategy.inner_done == 2
        _same([p.detach().numpy() for p in base.parameters()], want)
        _same([s.numpy() for s in strategy.shared], want_shared)
        model.close()


@pytest.fixture(scope="module")
def weighted() -> list[Any]:
    """2 ranks, H = 2, 4 steps, rank 0 with 5 samples per step and rank 1 with 3."""
    return [r.value for r in run_ranks(weighted_and_quiet, 2, 4, 2, timeout=60)]


@pytest.mark.slow
def test_pseudo_gradients_are_weighted_by_samples(weighted: list[Any]) -> None:
    """``set_samples``: rank 0's pseudo-gradient counts 10 (two steps of 5), rank
    1's 6: the hand computation's ``(10 d0 + 6 d1) / 16`` bit for bit (the ring
    adds the two weighted terms as the hand does), over two syncs."""
    for v in weighted:
        want, want_shared = v["reference"]  # by_hand, computed in the rank's process
        _same(v["params"], want)
        _same(v["params"], want_shared)
    # Rank 1 started from other weights: set-up gave it rank 0's.
    starts = zip(weighted[0]["start"], weighted[1]["start"], strict=True)
    assert any(not np.array_equal(a, b) for a, b in starts)


@pytest.mark.slow
def test_nothing_is_communicated_between_syncs(weighted: list[Any]) -> None:
    """Counted in each rank: no collective on the group or through torch.distributed
    in an inner step; the sync (every 2nd step) runs the all-reduce and the
    buffers' broadcast from rank 0, after which buffers are rank 0's everywhere."""
    for v in weighted:
        quiet, syncs = v["per_step"][0::2], v["per_step"][1::2]
        assert quiet == [0, 0], v["ops"]
        assert all(n > 0 for n in syncs), v["ops"]
    _same(weighted[1]["buffers"], weighted[0]["buffers"])


@pytest.mark.slow
def test_resume_between_syncs_and_at_one_is_bit_for_bit() -> None:
    """2 ranks, H = 3, 8 steps of AdamW with uneven ``set_samples``; stopped after
    step 4 (between syncs), 3 (at one) and 2 (through the strategy's own state
    dict), saved per rank and loaded into fresh objects: the uninterrupted run's
    weights and shared weights, bit for bit."""
    for r in run_ranks(resumed, 2, 8, 3, timeout=90):
        want = r.value["uninterrupted"]
        for key in ("files 4", "files 3", "strategy 2"):
            _same(r.value[key]["params"], want["params"])
            _same(r.value[key]["shared"], want["shared"])


@pytest.mark.slow
def test_loss_scaling_skips_per_worker_and_a_lost_step_is_named() -> None:
    """``gradhub.GradScaler``: the worker whose gradient overflowed skips alone, the
    skip counts as an inner step, the sync comes on time (replicas equal).
    ``torch.amp.GradScaler``: a skipped step never reaches the strategy; the next
    sync finds the backward counts differ and raises ``MisuseError`` on every rank."""
    for r in run_ranks(loss_scalers, 2, timeout=60):
        assert r.value["gradhub"] == {"skipped": 1 if r.rank == 1 else 0, "synced": True}
        refused = r.value["torch"]
        assert refused["error"] == "MisuseError", refused
        assert "gradhub.GradScaler" in refused["message"]


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"inner_steps": 0}, InvalidOptionError, "inner_steps must be an int >= 1"),
        ({"inner_steps": 2.5}, InvalidOptionError, "inner_steps must be an int >= 1"),
        ({"inner_steps": True}, InvalidOptionError, "inner_steps must be an int >= 1"),
        ({"outer_optimizer": "sgd"}, InvalidOptionError, "must be a callable"),
        ({"outer_optimizer": lambda ps: None}, InvalidOptionError, "not a torch.optim"),
        (
            {"outer_optimizer": lambda ps: torch.optim.SGD([torch.zeros(1)], lr=1.0)},
            InvalidOptionError,
            "exactly the parameters",
        ),
        ({"fragments": 4}, UnsupportedOptionError, "not available"),
        ({"servers": ["127.0.0.1:1"]}, UnsupportedOptionError, "not available"),
        ({"compress": "fp4"}, UnsupportedOptionError, "not available"),
        ({"sync_every": 10}, UnsupportedOptionError, "inner_steps"),
    ],
)
def test_bad_options_are_typed_errors_at_prepare_changing_nothing(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with gradhub.init(timeout=10) as runtime:
        base = mlp()
        before = [p.detach().clone() for p in base.parameters()]
        opt = torch.optim.SGD(base.parameters(), lr=0.1)
        with pytest.raises(error, match=match) as raised:
            gradhub.prepare(base, opt, strategy="diloco", runtime=runtime, **options)
        assert isinstance(raised.value, gradhub.GradhubError)
        assert "- help:" in str(raised.value)
        for p, b in zip(base.parameters(), before, strict=True):
            assert torch.equal(p, b)
        # No hook was left behind: the script's own optimizer and backward run as before.
        nn.functional.cross_entropy(base(torch.randn(2, 6)), torch.tensor([0, 1])).backward()
        opt.step()


def test_fit_runs_diloco_with_its_options() -> None:
    """``DataParallelTrainer(..., strategy="diloco", inner_steps=4, outer_optimizer=...)``:
    fit's loop takes the options; 8 steps make 2 outer steps."""
    x = torch.randn(64, 6, generator=torch.Generator().manual_seed(0))
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    outer_steps: list[int] = []

    def outer(params: list[torch.Tensor]) -> torch.optim.Optimizer:
        opt = torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)
        opt.register_step_post_hook(lambda *_: outer_steps.append(1))
        return opt

    with gradhub.init(timeout=10) as runtime:
        base = mlp()
        with gradhub.DataParallelTrainer(
            base,
            torch.optim.AdamW(base.parameters(), lr=0.01),
            strategy="diloco",
            runtime=runtime,
            inner_steps=4,
            outer_optimizer=outer,
        ) as trainer:
            result = trainer.fit((x, y), epochs=1, batch_size=8)
    assert result.steps == 8
    assert len(outer_steps) == 2
