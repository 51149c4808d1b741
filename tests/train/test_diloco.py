"""The ``diloco`` strategy: inner steps on each worker, an outer step at every sync.

References: ``allreduce`` (H = 1 is a synchronous step), and DiLoCo written
out by hand in one process (``diloco_jobs.by_hand``: plain models and inner
optimizers, the pseudo-gradients weighted and averaged, Nesterov SGD on the
shared weights), which performs the same float32 operations in the same
order as the strategy, so it is compared bit for bit (computed in the
process it is compared with: torch's kernels round by their thread count).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
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
    streaming,
    streaming_by_hand,
    weighted_and_quiet,
)
from gradhub.errors import InvalidOptionError, UnsupportedOptionError
from gradhub.train.strategies.diloco import DiLoCoStrategy
from gradhub.train.strategies.diloco.fragments import cut, offsets
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
def test_streaming_resume_with_an_exchange_in_flight_is_bit_for_bit() -> None:
    """2 ranks, H = 4, two fragments, overlap 1, uneven ``set_samples``, 8 steps:
    stopped after step 5 (fragment 0 just merged), 4 (its exchange in flight:
    ``state_dict`` waits for it and saves its sum) and 2 (fragment 1's in flight,
    through the strategy's own state dict), resumed into fresh objects: the
    uninterrupted run's weights and shared weights, bit for bit."""
    job = functools.partial(resumed, fragments=2, overlap=1)
    for r in run_ranks(job, 2, 8, 4, timeout=90):
        want = r.value["uninterrupted"]
        for key in ("files 5", "files 4", "strategy 2"):
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
        ({"asynchronous": True}, UnsupportedOptionError, "diloco_mode='async'"),
        ({"fragments": 0}, InvalidOptionError, "fragments must be an int from 1"),
        ({"fragments": 3, "inner_steps": 2}, InvalidOptionError, "fragments must be"),
        ({"fragments": 5}, InvalidOptionError, "has 4 trainable parameters"),
        ({"overlap": 2, "fragments": 2, "inner_steps": 4}, InvalidOptionError, "overlap must"),
        ({"overlap": -1}, InvalidOptionError, "overlap must"),
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


# streaming DiLoCo: fragments, overlap, compressed pseudo-gradients -------------------


def test_fragments_are_contiguous_about_equal_and_staggered() -> None:
    """The rule of ``fragments.cut``: each fragment ends at the first parameter
    boundary at or past ``(f + 1) / F`` of the elements, holding at least one."""
    assert cut([96, 16, 48, 3], 1) == [range(0, 4)]
    assert cut([96, 16, 48, 3], 2) == [range(0, 1), range(1, 4)]
    assert cut([96, 16, 48, 3], 3) == [range(0, 1), range(1, 2), range(2, 4)]
    assert cut([10] * 10, 3) == [range(0, 4), range(4, 7), range(7, 10)]
    assert cut([1000, 1, 1], 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert offsets(6, 3) == [0, 2, 4] and offsets(7, 3) == [0, 2, 4] and offsets(5, 1) == [0]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=12), st.integers(1, 12))
def test_fragments_cover_the_parameters_in_order(sizes: list[int], count: int) -> None:
    count = min(count, len(sizes))
    parts = cut(sizes, count)
    assert len(parts) == count and all(len(p) >= 1 for p in parts)
    assert [i for p in parts for i in p] == list(range(len(sizes)))
    total = sum(sizes)
    for f, part in enumerate(parts[:-1]):
        done = sum(sizes[: part[-1] + 1])
        # At or past (f + 1) / F of the elements, unless later fragments need the rest.
        assert done * count >= (f + 1) * total or part[-1] + 1 == len(sizes) - (count - f - 1)
        # The first such boundary: one parameter less falls short (or the part has one).
        assert len(part) == 1 or (done - sizes[part[-1]]) * count < (f + 1) * total


def test_one_worker_overlap_keeps_the_progress_of_the_overlapped_steps() -> None:
    """World 1, H = 4, two fragments (offsets 0 and 2), overlap 1, 11 steps: the
    hand computation (``streaming_by_hand``: the outer step merged one step after
    each fragment's sync, its weights the new shared ones plus the step's local
    progress) bit for bit; an exchange stays in flight at the end (step 10 synced
    fragment 1), and ``close`` waits for it."""
    want, want_shared = streaming_by_hand(1, 11, 4, 2, 1, "none")
    with gradhub.init(timeout=10) as runtime:
        base = mlp()
        model, opt = gradhub.prepare(
            base,
            sgd_momentum(base),
            strategy="diloco",
            runtime=runtime,
            inner_steps=4,
            fragments=2,
            overlap=1,
        )
        loop(model, opt, 0, range(11))
        _same([p.detach().numpy() for p in base.parameters()], want)
        _same([s.numpy() for s in model.strategy.shared], want_shared)
        model.close()


@pytest.fixture(scope="module")
def streamed() -> list[Any]:
    """2 ranks, 12 steps of each run of ``diloco_jobs.streaming``."""
    return [r.value for r in run_ranks(streaming, 2, 12, timeout=90)]


@pytest.mark.slow
def test_each_fragment_syncs_once_per_period_at_its_offset(streamed: list[Any]) -> None:
    """H = 6, F = 3 (offsets 0, 2, 4), overlap 1: fragment f's exchange starts after
    steps 2, 8 (f = 1), 4, 10 (f = 2), 6, 12 (f = 0), each carrying that fragment's
    elements alone; the group gets its two operations (the pseudo-gradient, the
    tally) at those steps and none at the others (the merge waits only)."""
    for v in streamed:
        run = v["fragments"]
        assert run["fragments"] == [[0], [1], [2, 3]]
        sizes = {0: 96, 1: 16, 2: 48 + 3}
        want = [(2, sizes[1]), (4, sizes[2]), (6, sizes[0])]
        assert run["started"] == want + [(s + 6, n) for s, n in want]
        assert run["submits"] == [2 if (step + 1) % 2 == 0 else 0 for step in range(12)]


@pytest.mark.slow
@pytest.mark.parametrize("run", ["fragments", "blocking", "bf16", "fp4", "weighted"])
def test_streaming_runs_are_the_hand_computation_on_every_rank(
    streamed: list[Any], run: str
) -> None:
    """Every run against ``streaming_by_hand`` with the world of 2 bit for bit (the
    ring adds rank 0's term and rank 1's as the hand does; the codecs' terms are
    decoded and added in rank order); the shared weights are the same bits on both
    ranks. ``weighted``: fp4, overlap 1 and ``set_samples`` (each pseudo-gradient
    weighted by the samples since its fragment's sync started). ``blocking``
    (F = 1, overlap 0, compress "none" given) is also the plain ``diloco`` hand
    computation (``by_hand``) bit for bit."""
    for v in streamed:
        want, want_shared = v[run]["reference"]
        _same(v[run]["shared"], want_shared)
        if v is streamed[0]:
            _same(v[run]["params"], want)
    _same(streamed[1][run]["shared"], streamed[0][run]["shared"])
    if run == "blocking":
        plain, plain_shared = by_hand(2, 12, 3, sgd_momentum)
        _same(streamed[0][run]["params"], plain)
        _same(streamed[1][run]["params"], plain)
        _same(streamed[0][run]["shared"], plain_shared)


@pytest.mark.slow
def test_fp4_is_in_the_path(streamed: list[Any]) -> None:
    """The fp4 run is not the fp32 one on the same data (the hand computation
    above would match a run that skipped the codec, had it skipped it too)."""
    _, fp32_shared = streaming_by_hand(2, 12, 4, 2, 0, "none")
    got = streamed[0]["fp4"]["shared"]
    assert any(not np.array_equal(g, w) for g, w in zip(got, fp32_shared, strict=True))
    assert all(np.isfinite(g).all() for g in got)
