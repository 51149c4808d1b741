"""``diloco`` with parameter servers (``servers=``): the servers hold the shared
weights and run the outer optimizer. Server processes started here, workers
run by the harness (real processes)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import gradhub
from diloco_jobs import mlp
from diloco_server_jobs import RUNS, resumed_with_servers, staleness, with_and_without_servers
from gradhub.errors import InvalidOptionError, OptimizerMismatchError, UnsupportedOptionError
from gradhub.optim import OptimizerSpec
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.launch import ServerHandle, start_server
from harness import run_ranks

EPS = float(np.finfo(np.float32).eps)
NESTEROV = OptimizerSpec.of("sgd", lr=0.7, momentum=0.9, nesterov=True)


@contextlib.contextmanager
def servers(count: int, *, in_thread: bool = False, **options: Any) -> Iterator[list[ServerHandle]]:
    """``count`` server processes (threads of this one: ``in_thread``) of
    ``ServerConfig(**options)``."""
    config = ServerConfig(**options)
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(start_server(config, in_thread=in_thread, start_timeout=120))
            for _ in range(count)
        ]


def _close(got: list[np.ndarray], want: list[np.ndarray], atol: float) -> float:
    """Asserts every tensor within ``atol``; returns the largest difference."""
    worst = 0.0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol, err_msg=f"tensor {i}")
        worst = max(worst, float(np.abs(g - w).max()))
    return worst


# the outer optimizer on the servers ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fixed", [False, True], ids=["workers-spec", "fixed-nesterov"])
@pytest.mark.parametrize("weights", [(1, 1), (5, 3)], ids=["mean", "weighted"])
def test_servers_outer_step_is_torch_nesterov_sgd_step_by_step(
    fixed: bool, weights: tuple[int, int]
) -> None:
    """A server process in sync mode, two workers pushing ``d_i * w_i / sum(w)``
    (what ``diloco`` pushes) for 6 rounds, against ``torch.optim.SGD(lr=0.7,
    momentum=0.9, nesterov=True)`` stepping the same fp32 weights in this process
    on ``(w_0 d_0 + w_1 d_1) / sum(w)`` (what ``diloco`` without servers steps on):
    after every round the pulled weights and the momentum buffer.

    Tolerance: equal weights are exact (halving is exact, and two terms add in
    either order to the same bits), so the weights must be bit for bit.
    Weighted, the server adds ``w_i d_i / 8`` where the local step divides the
    sum by 8: up to one rounding of each term and of the sum, a few ulps of the
    largest pseudo-gradient per round, which momentum carries on; bounded by
    ``8 * rounds * eps`` of the largest weight."""
    config: dict[str, Any] = {"mode": "sync", "workers": 2}
    if fixed:  # a server fixed to the outer optimizer takes the same spec from the init
        config["optimizer"] = NESTEROV
    g = torch.Generator().manual_seed(0)
    start = torch.randn(40, 5, generator=g)
    local = start.clone()
    outer = torch.optim.SGD([local], lr=0.7, momentum=0.9, nesterov=True)
    total = float(sum(weights))
    rounds = 6
    with servers(1, **config) as (server,), contextlib.ExitStack() as stack:
        clients = [
            stack.enter_context(gradhub.RemoteParameterServer(server.address, worker_id=w))
            for w in (0, 1)
        ]
        clients[0].init("w", start, optimizer=NESTEROV)
        for _ in range(rounds):
            d = [torch.randn(40, 5, generator=g) * 0.1 for _ in (0, 1)]
            pushes = [c.push("w", d[w] * weights[w] / total) for w, c in enumerate(clients)]
            for p in pushes:
                p.result(30)
            pulled = [torch.empty_like(start) for _ in clients]
            for c, out in zip(clients, pulled, strict=True):
                c.pull("w", out).result(30)  # returns once the round is applied
            local.grad = (d[0] * weights[0] + d[1] * weights[1]) / total
            outer.step()
            assert torch.equal(pulled[0], pulled[1])
            momentum = clients[0].optimizer_state("w", start)["momentum_buffer"]
            if weights == (1, 1):
                assert torch.equal(pulled[0], local)
                assert torch.equal(momentum, outer.state[local]["momentum_buffer"])
            else:
                bound = 8 * rounds * EPS * float(local.abs().max())
                torch.testing.assert_close(pulled[0], local, rtol=0, atol=bound)
        assert not torch.equal(local, start)


def test_a_server_fixed_to_another_outer_optimizer_is_named() -> None:
    """``gradhub serve --optimizer sgd --momentum 0.9`` (no Nesterov) refuses the
    default outer optimizer at set-up, naming both."""
    spec = OptimizerSpec.of("sgd", lr=0.7, momentum=0.9)
    with (
        servers(1, mode="sync", workers=1, optimizer=spec, in_thread=True) as (server,),
        gradhub.init(timeout=10) as runtime,
    ):
        base = mlp()
        opt = torch.optim.SGD(base.parameters(), lr=0.1)
        with pytest.raises(OptimizerMismatchError, match="nesterov=True"):
            gradhub.prepare(base, opt, strategy="diloco", runtime=runtime, servers=[server.address])


# the strategy with servers -------------------------------------------------------------


@pytest.mark.slow
def test_sync_mode_with_servers_is_diloco_without_them() -> None:
    """2 ranks, 9 steps (H = 3; streaming: H = 4, two fragments, overlap 1, bf16,
    the sync of step 8 merged at step 9): with servers in sync mode, the weights
    and shared weights of the same run without servers, on every rank.

    Tolerance: ``plain`` and ``streaming`` push halves of the pseudo-gradients
    (exact, and two terms add to the same bits in either order: the bf16 of a
    half is half the bf16), so they must be bit for bit. ``weighted`` (5 and 3
    samples per step) divides each term by the summed weights before the sum
    instead of after: a few ulps per outer step, bounded by 16 ulps of the
    largest weight over its 2 outer steps and the inner steps after."""
    with servers(len(RUNS), mode="sync", workers=2) as handles:
        addresses = {run: h.address for run, h in zip(RUNS, handles, strict=True)}
        ranks = run_ranks(with_and_without_servers, 2, 9, addresses, timeout=120)
    for r in ranks:
        for run in RUNS:
            local, remote = r.value[f"{run} local"], r.value[f"{run} servers"]
            largest = max(float(np.abs(a).max()) for a in local["shared"])
            atol = 16 * EPS * largest if run == "weighted" else 0.0
            for what in ("shared", "params"):
                if atol:
                    _close(remote[what], local[what], atol)
                else:
                    for g, w in zip(remote[what], local[what], strict=True):
                        assert np.array_equal(g, w), (run, what, np.abs(g - w).max())
    shared = [r.value["plain servers"]["shared"] for r in ranks]
    assert all(np.array_equal(a, b) for a, b in zip(*shared, strict=True))


@pytest.mark.slow
def test_async_mode_bounds_the_staleness_of_a_slow_worker() -> None:
    """``diloco_mode="async"``, servers in ssp mode with ``max_staleness=1``, H = 2,
    16 steps; rank 1 sleeps 0.15 s per inner step. Whenever rank 0's sync
    returns (its pull), the servers count rank 1 at most 1 sync behind it;
    and rank 0 did run ahead (an async run, not lockstep): at some sync it was
    1 ahead. Both end with finite weights after 8 pushes each."""
    k = 1
    with servers(1, mode="ssp", workers=2, max_staleness=k) as (server,):
        ranks = run_ranks(staleness, 2, 16, 2, server.address, 0.15, timeout=120)
    fast = ranks[0].value["seen"]
    assert len(fast) == 8
    gaps = [s["0"] - s.get("1", 0) for s in fast]
    assert all(gap <= k for gap in gaps), gaps
    assert max(gaps) == k, gaps
    assert ranks[1].value["seen"][-1] == {"0": 8, "1": 8}
    for r in ranks:
        assert all(np.isfinite(a).all() for a in r.value["params"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("inner_steps", "options"),
    [(3, {}), (4, {"fragments": 2, "overlap": 1})],
    ids=["between-syncs", "sync-in-flight"],
)
def test_resume_with_servers_pulls_their_weights_and_keeps_their_outer_state(
    inner_steps: int, options: dict[str, Any]
) -> None:
    """2 ranks, AdamW inside, uneven ``set_samples``; with servers (sync), stopped
    after step 4 (H = 3: between syncs; H = 4, two fragments, overlap 1: fragment
    0's sync in flight, its pull waited for and saved with the shared weights),
    saved per rank, closed; fresh objects with other weights prepared against
    the same servers take the servers' shared weights before any load; after
    loading their files and 5 more steps (the last sync merged: a pull in flight
    fills the shared weights as it lands): the uninterrupted run without servers.
    The file holds no outer state (the servers' Nesterov momentum, had it been
    lost, would change the second sync). Tolerance: the weighted terms, as in
    the sync test (16 ulps of the largest)."""
    job = functools.partial(resumed_with_servers, **options)
    with servers(1, mode="sync", workers=2) as (server,):
        ranks = run_ranks(job, 2, 9, inner_steps, 4, server.address, timeout=120)
    for r in ranks:
        v = r.value
        assert v["saved outer"] is None
        assert v["in flight"] == bool(options)
        _close(v["pulled"], v["shared at stop"], 0.0)
        want = v["uninterrupted"]
        largest = max(float(np.abs(a).max()) for a in want["shared"])
        for what in ("shared", "params"):
            _close(v["resumed"][what], want[what], 16 * EPS * largest)


# refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"servers": ["tcp://127.0.0.1:9"], "compress": "fp4"}, UnsupportedOptionError, "fp4"),
        ({"diloco_mode": "async"}, InvalidOptionError, "needs servers="),
        ({"diloco_mode": "later"}, InvalidOptionError, "diloco_mode must be one of"),
        ({"servers": []}, InvalidOptionError, "servers must be"),
        ({"servers": [5]}, InvalidOptionError, "servers must be"),
        ({"servers": "tcp://127.0.0.1:9", "timeout": 0}, InvalidOptionError, "timeout"),
        ({"asynchronous": True}, UnsupportedOptionError, "diloco_mode='async'"),
    ],
)
def test_server_options_are_refused_at_prepare_saying_why(
    options: dict[str, Any], error: type[Exception], match: str
) -> None:
    with gradhub.init(timeout=10) as runtime:
        base = mlp()
        opt = torch.optim.SGD(base.parameters(), lr=0.1)
        with pytest.raises(error, match=match) as raised:
            gradhub.prepare(base, opt, strategy="diloco", runtime=runtime, **options)
        assert "- help:" in str(raised.value)


def test_servers_in_the_wrong_mode_or_round_size_are_named() -> None:
    """``diloco_mode="async"`` against sync servers, ``"sync"`` against servers
    whose rounds wait for another number of workers: errors saying what to start."""
    with (
        servers(1, mode="sync", in_thread=True, workers=2) as (server,),
        gradhub.init(timeout=10) as runtime,
    ):
        for options, match in (
            ({"diloco_mode": "async"}, "needs servers in mode 'ssp'"),
            ({}, "wait for 2"),
        ):
            base = mlp()
            opt = torch.optim.SGD(base.parameters(), lr=0.1)
            with pytest.raises(gradhub.GradhubError, match=match):
                gradhub.prepare(
                    base,
                    opt,
                    strategy="diloco",
                    runtime=runtime,
                    servers=[server.address],
                    timeout=5,
                    **options,
                )


def test_a_custom_outer_optimizer_class_is_refused_with_servers() -> None:
    """The servers rebuild the outer optimizer by its torch.optim name."""

    class Mine(torch.optim.SGD):
        pass

    with (
        servers(1, mode="sync", in_thread=True, workers=1) as (server,),
        gradhub.init(timeout=10) as runtime,
    ):
        base = mlp()
        with pytest.raises(InvalidOptionError, match=r"must build a torch\.optim optimizer"):
            gradhub.prepare(
                base,
                torch.optim.SGD(base.parameters(), lr=0.1),
                strategy="diloco",
                runtime=runtime,
                servers=[server.address],
                outer_optimizer=lambda ps: Mine(ps, lr=0.7),
            )
