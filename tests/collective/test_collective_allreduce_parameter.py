"""AllReduceParameter and ShardedOptimizer on real processes (gloo on 127.0.0.1).

Each spawned job groups several checks, to keep process start-ups few.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from gradhub import AllReduceParameter, ShardedOptimizer
from gradhub.collective import CollectiveGroup, local_group
from gradhub.errors import (
    ClosedError,
    CollectiveTimeoutError,
    ShapeMismatchError,
    StateError,
)
from gradhub.trees import TreeSpec
from harness import free_port, run_ranks

STEPS = 10
Factory = Callable[[list[torch.Tensor]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Factory] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.05),
}


def initial_params(size_hint: int = 4) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(size_hint, 3, generator=g),
        "b": torch.randn(3, generator=g),
        "s": torch.ones(1),
    }


def rank_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Different data, and a different number of samples, on every rank."""
    g = torch.Generator().manual_seed(100 + rank)
    n = 5 + rank
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


def summed_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    pred = (x @ params["w"] + params["b"]) * params["s"]
    return ((pred - y) ** 2).sum()


def single_process_training(world_size: int, optimizer: str) -> torch.Tensor:
    """The reference: the same steps on the concatenated data, one process."""
    params = {k: v.clone().requires_grad_(True) for k, v in initial_params().items()}
    data = [rank_data(r) for r in range(world_size)]
    x = torch.cat([d[0] for d in data])
    y = torch.cat([d[1] for d in data])
    opt = OPTIMIZERS[optimizer](list(params.values()))
    for _ in range(STEPS):
        opt.zero_grad()
        (summed_loss(params, x, y) / x.shape[0]).backward()
        opt.step()
    return TreeSpec.of(params).flatten(params)


def distributed_training(
    group: CollectiveGroup, optimizer: str, compress: str = "none"
) -> torch.Tensor:
    rank, world_size = group.rank, group.world_size
    total = sum(rank_data(r)[0].shape[0] for r in range(world_size))
    x, y = rank_data(rank)
    local = {k: v.clone().requires_grad_(True) for k, v in initial_params().items()}
    spec = TreeSpec.of(local)
    with AllReduceParameter(spec.numel, group=group, compress=compress) as p:
        pid, start, length = p.init(local)
        assert (pid, start, length) == (rank, *p.local_partition_range)
        opt = ShardedOptimizer(p, OPTIMIZERS[optimizer])
        for _ in range(STEPS):
            assert p.get_weights(local).wait() is local
            grads = torch.autograd.grad(summed_loss(local, x, y), list(local.values()))
            p.put_gradients(dict(zip(local, grads, strict=True)))
            opt.step(avg_numbers=total)
        p.get_weights(local).wait()
        # Optimizer state lives on the owner only: it covers this rank's slice.
        for state in opt.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.dim() == 1:
                    assert value.numel() == length
    return spec.flatten(local)


def check_training(group: CollectiveGroup) -> dict[str, torch.Tensor]:
    out = {}
    for name in OPTIMIZERS:
        got = distributed_training(group, name)
        want = single_process_training(group.world_size, name)
        # fp32 sums in another order (per-rank partial sums, then the ring's
        # order) instead of one autograd pass over the whole batch: each step
        # differs by a few ulps, and 10 steps of a well-conditioned least-squares
        # problem do not amplify that beyond ~1e-6 relative.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        out[name] = got
    # bf16 on the wire: within bf16's relative error (2**-8) of the fp32 run
    # per step, compounded over 10 steps; 2e-2 is a loose, explained bound.
    got = distributed_training(group, "sgd", compress="bf16")
    torch.testing.assert_close(got, out["sgd"], rtol=2e-2, atol=2e-2)
    out["sgd-bf16"] = got
    return out


def check_errors(group: CollectiveGroup) -> None:
    rank = group.rank
    # Different sizes on different ranks: a clear error on every rank.
    p = AllReduceParameter(10 + rank, group=group)
    with pytest.raises(ShapeMismatchError, match=r"sizes by rank \{0: 10, 1: 11\}"):
        p.init(torch.zeros(10 + rank))
    # A parameter of the wrong number of elements on one rank: error on every rank.
    p = AllReduceParameter(6, group=group)
    with pytest.raises(ShapeMismatchError, match=r"elements by rank \{1: 7\}"):
        p.init(torch.zeros(6 + rank))
    # Misuse is refused with the call to make.
    p = AllReduceParameter(6, group=group)
    with pytest.raises(StateError, match="init"):
        p.put_gradients(torch.zeros(6))
    p.init(torch.arange(6.0))
    with pytest.raises(StateError, match="put_gradients"):
        p.aggregate_gradient_partition(1)
    with pytest.raises(ShapeMismatchError):
        p.get_weights(torch.zeros(5))
    p.put_gradients(torch.ones(6))
    with pytest.raises(StateError, match="twice"):
        p.put_gradients(torch.ones(6))
    with pytest.raises(ValueError, match="avg_numbers"):
        p.aggregate_gradient_partition(0)
    assert torch.equal(p.aggregate_gradient_partition(4), torch.full((3,), 0.5))
    # Published weights are a snapshot: in-place changes show after send_weight_partition.
    p.weight_partition.add_(100)
    assert torch.equal(p.get_weights(torch.zeros(6)).wait(), torch.arange(6.0))
    p.send_weight_partition()
    assert torch.equal(p.get_weights(torch.zeros(6)).wait(), torch.arange(6.0) + 100)
    p.close()
    with pytest.raises(ClosedError):
        p.get_weights(torch.zeros(6))


def two_rank_job(rank: int, world_size: int, port: int) -> dict[str, np.ndarray]:
    torch.set_num_threads(1)
    with local_group(rank, world_size, port, timeout=60) as group:
        check_errors(group)
        return {k: v.numpy() for k, v in check_training(group).items()}


def three_rank_job(rank: int, world_size: int, port: int) -> dict[str, np.ndarray]:
    torch.set_num_threads(1)
    with local_group(rank, world_size, port, timeout=60) as group:
        out = check_training(group)
        # size < world size: rank 2 owns an empty slice and still takes part.
        with AllReduceParameter(2, group=group, compress="fp16") as p:
            assert p.init(torch.tensor([1.0, 2.0]))[2] == (1 if rank < 2 else 0)
            opt = ShardedOptimizer(p, OPTIMIZERS["adam"])
            p.put_gradients(torch.tensor([1.0, -1.0]) * (rank + 1))
            opt.step(avg_numbers=6)
            got = p.get_weights(torch.zeros(2)).wait()
        # Adam's first step moves every weight by lr against the gradient's
        # sign; the weights come back through fp16 (relative error <= 2**-11).
        torch.testing.assert_close(got, torch.tensor([0.95, 2.05]), rtol=2.0**-11, atol=0)
        out["small"] = got
        return {k: v.numpy() for k, v in out.items()}


@pytest.mark.slow
@pytest.mark.parametrize(("world_size", "job"), [(2, two_rank_job), (3, three_rank_job)])
def test_training_through_allreduce_parameter_matches_single_process(
    world_size: int, job: Callable[..., dict[str, np.ndarray]]
) -> None:
    results = [r.value for r in run_ranks(job, world_size, free_port(), timeout=150)]
    # Every rank holds bit-identical weights after every run (results come
    # back as NumPy arrays: tensors would travel through shared memory that
    # the exiting child takes with it).
    for name, value in results[0].items():
        for other in results[1:]:
            np.testing.assert_array_equal(other[name], value, err_msg=name)


ABSENT = 1
TIMEOUT = 3.0


def _user_group(rank: int, world_size: int, port: int) -> dist.TCPStore:
    """The default group made the way a torch user makes it, with the test's timeout."""
    # The store waits (60 s) until every rank has connected, so the short
    # group timeout only bounds the collectives, not process start-up.
    store = dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=TIMEOUT)
    )
    return store


def timeout_job(
    rank: int, world_size: int, port: int, size: int, user_group: bool, transport: str
) -> tuple[str, list[int], str, float]:
    torch.set_num_threads(1)
    os.environ["GRADHUB_TRANSPORT"] = transport  # this child process only
    if user_group:
        store = _user_group(rank, world_size, port)
        # No timeout anywhere in gradhub: the user's group's own one applies.
        p = AllReduceParameter(size)
    else:
        # The group's own timeout bounds how long a broken group takes to tear down.
        group = local_group(rank, world_size, port, timeout=10)
        assert group.store is not None
        store = group.store
        p = AllReduceParameter(size, group=group, timeout=TIMEOUT)
    try:
        p.init(torch.zeros(size))
        if rank == ABSENT:
            # Alive but not taking part, until the others have given up.
            with contextlib.suppress(RuntimeError):  # rank 0's store may be gone already
                store.wait(
                    [f"test-done/{r}" for r in range(world_size) if r != ABSENT],
                    timedelta(seconds=30),
                )
            return ("absent", [], "", 0.0)
        begin = time.monotonic()
        p.put_gradients(torch.ones(size))
        with pytest.raises(CollectiveTimeoutError) as caught:
            p.aggregate_gradient_partition(1)
        elapsed = time.monotonic() - begin
        # The group is broken now; further use says so instead of hanging.
        with pytest.raises(StateError, match="broken"):
            p.get_weights(torch.zeros(size)).wait()
        store.set(f"test-done/{rank}", "1")
        if rank == 0:  # hosts the store: it stays until the others have used it
            store.wait(
                [f"test-done/{r}" for r in range(world_size) if r != ABSENT],
                timedelta(seconds=30),
            )
        err = caught.value
        return (str(err), list(err.missing_ranks), err.operation, elapsed)
    finally:
        p.close()
        if user_group:
            dist.destroy_process_group()
        else:
            group.close()


# On the ring, 100 elements go through gloo's collectives, 2M (8 MB > SMALL_BYTES)
# through point-to-point messages; the third case sets the default group up as a
# torch user does, with its own timeout, and gives gradhub none; shared memory
# waits on its counters.
@pytest.mark.slow
@pytest.mark.parametrize(
    ("size", "user_group", "transport"),
    [(100, False, "ring"), (2_000_000, False, "ring"), (100, True, "ring"), (100, False, "shm")],
)
def test_a_rank_that_does_not_take_part_is_named_within_the_timeout(
    size: int, user_group: bool, transport: str
) -> None:
    # A generous bound for start-up and teardown on a loaded machine; the
    # timing that matters is measured inside the ranks.
    results = run_ranks(timeout_job, 3, free_port(), size, user_group, transport, timeout=180)
    assert not any(r.killed for r in results), "a process hung"
    for r in results:
        if r.rank == ABSENT:
            continue
        message, missing, operation, elapsed = r.value
        # Rank 2 waits on rank 1 directly; rank 0 waits on rank 2, which
        # gives up and leaves: the check-in still names rank 1 on both.
        assert missing == [ABSENT], message
        assert "put_gradients" in operation
        assert f"rank(s) {ABSENT} (not entered the operation" in message
        assert f"after {TIMEOUT:g}s" in message
        # Loose (several times the timeout, so a loaded machine cannot fail
        # it), yet far below the 300 s default that an ignored timeout gives.
        assert elapsed < 5 * TIMEOUT, elapsed
