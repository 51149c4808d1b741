"""AllReduceParameter's zero-copy cycle: a model bound to the flat buffers
(parameters views of ``flat_weights``, grads views of ``flat_gradients``)
against the same model driven through the seed API (copies), 2 real ranks,
on shared memory and on the gloo ring."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from gradhub import AllReduceParameter
from gradhub.collective import CollectiveGroup, allreduce_parameter, local_group
from harness import free_port, run_ranks

LR = 0.01
CYCLES = 3


class CountCopies(TorchDispatchMode):
    """Counts ``aten.copy_`` calls on this thread (where put_gradients and
    send_weight_partition copy, if they copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.copy_.default:
            self.copies += 1
        return func(*args, **(kwargs or {}))


def make_model() -> nn.Module:
    # > 4 MB of fp32: the ring's point-to-point path, not its small-vector one
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(32, 1024), nn.Tanh(), nn.Linear(1024, 1040))


def loss_of(model: nn.Module, rank: int, cycle: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * cycle + rank)
    x = torch.randn(6 + rank, 32, generator=g)
    return model(x).square().mean()


def spy_collectives(calls: list[tuple[str, int, int]]) -> None:
    """Record (name, source address, output address) of every collective the
    parameter runs (on its worker thread)."""
    rs, ag = allreduce_parameter.run_reduce_scatter, allreduce_parameter.run_all_gather

    def reduce_scatter(group: Any, flat: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        calls.append(("rs", flat.data_ptr(), k["out"].data_ptr()))
        return rs(group, flat, *a, **k)

    def all_gather(group: Any, wire: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
        out = k["out"]
        calls.append(("ag", wire.data_ptr(), 0 if out is None else out.data_ptr()))
        return ag(group, wire, *a, **k)

    allreduce_parameter.run_reduce_scatter = reduce_scatter  # type: ignore[assignment]
    allreduce_parameter.run_all_gather = all_gather  # type: ignore[assignment]


def check_views(group: CollectiveGroup) -> None:
    rank = group.rank
    seed_model, bound_model = make_model(), make_model()
    seed_params, bound_params = list(seed_model.parameters()), list(bound_model.parameters())
    n = sum(q.numel() for q in seed_params)
    with (
        AllReduceParameter(n, group=group) as seed,
        AllReduceParameter(n, group=group) as views,
    ):
        seed.init(seed_params)
        views.init(bound_params)
        views.bind(bound_params)
        weights, grads = views.flat_weights, views.flat_gradients
        start = views.local_partition_range[0]
        assert views.weight_partition.data_ptr() == weights.data_ptr() + 4 * start
        addresses = []
        offset = 0
        for q in bound_params:
            assert q.data_ptr() == weights.data_ptr() + 4 * offset
            assert q.grad is not None and q.grad.data_ptr() == grads.data_ptr() + 4 * offset
            addresses.append((q.data_ptr(), q.grad.data_ptr()))
            offset += q.numel()
        calls: list[tuple[str, int, int]] = []
        spy_collectives(calls)
        for cycle in range(CYCLES):
            # the seed API: any tensors, copied in and out
            seed_model.zero_grad()
            loss_of(seed_model, rank, cycle).backward()
            seed.put_gradients([q.grad for q in seed_params])
            seed.weight_partition.sub_(LR * seed.aggregate_gradient_partition(2))
            seed.send_weight_partition()
            seed.get_weights(seed_params).wait()
            # the bound model: nothing copied, nothing reallocated
            grads.zero_()
            loss_of(bound_model, rank, cycle).backward()
            calls.clear()
            with CountCopies() as counted:
                views.put_gradients([q.grad for q in bound_params])
                views.weight_partition.sub_(LR * views.aggregate_gradient_partition(2))
                views.send_weight_partition()
                future = views.get_weights(bound_params)
            future.wait()
            assert counted.copies == 0, f"{counted.copies} copies on the caller's thread"
            own_grads = grads.data_ptr() + 4 * start
            own_weights = weights.data_ptr() + 4 * start
            assert calls == [
                ("rs", grads.data_ptr(), own_grads),
                ("ag", own_weights, weights.data_ptr()),
            ], calls
            assert [(q.data_ptr(), q.grad.data_ptr()) for q in bound_params] == addresses  # type: ignore[union-attr]
            # the same bits as the seed API gives
            for a, b in zip(seed_params, bound_params, strict=True):
                assert torch.equal(a, b), f"cycle {cycle}: bound weights differ"
        # the bound parameter still takes any tensor, copied
        other = torch.randn(n, generator=torch.Generator().manual_seed(rank))
        views.put_gradients(other)
        seed.put_gradients(other)
        assert torch.equal(
            views.aggregate_gradient_partition(), seed.aggregate_gradient_partition()
        )
        views.send_weight_partition()
        seed.send_weight_partition()
        copy = [torch.zeros_like(q) for q in bound_params]
        views.get_weights(copy).wait()
        assert all(torch.equal(a, b) for a, b in zip(copy, seed_params, strict=True))


def check_views_lossy(group: CollectiveGroup) -> None:
    """With bf16 on the wire the master stays apart from the flat weights, which
    hold the decoded wire values on every rank: the seed API's bits."""
    rank = group.rank
    seed_model, bound_model = make_model(), make_model()
    seed_params, bound_params = list(seed_model.parameters()), list(bound_model.parameters())
    n = sum(q.numel() for q in seed_params)
    with (
        AllReduceParameter(n, group=group, compress="bf16") as seed,
        AllReduceParameter(n, group=group, compress="bf16") as views,
    ):
        seed.init(seed_params)
        views.init(bound_params)
        seed.get_weights(seed_params).wait()
        views.bind(bound_params)
        views.get_weights(bound_params).wait()
        for a, b in zip(seed_params, bound_params, strict=True):
            assert torch.equal(a, b), "not the decoded wire values"
        for cycle in range(2):
            for model, p, params in (
                (seed_model, seed, seed_params),
                (bound_model, views, bound_params),
            ):
                model.zero_grad(set_to_none=False)
                loss_of(model, rank, cycle).backward()
                p.put_gradients([q.grad for q in params])
                p.weight_partition.sub_(LR * p.aggregate_gradient_partition(2))
                p.send_weight_partition()
                p.get_weights(params).wait()
            assert torch.equal(seed.weight_partition, views.weight_partition)
            for a, b in zip(seed_params, bound_params, strict=True):
                assert torch.equal(a, b), f"bf16 cycle {cycle}: bound weights differ"


def views_job(rank: int, world_size: int, port: int) -> None:
    torch.set_num_threads(1)
    with local_group(rank, world_size, port, timeout=60, transport="ring") as ring:
        shm = ring.sibling()  # same process group, its own transport
        shm.transport = "shm"
        try:
            for group in (shm, ring):
                check_views(group)
                allreduce_parameter.run_reduce_scatter = RS
                allreduce_parameter.run_all_gather = AG
            check_views_lossy(shm)
        finally:
            shm.close()


RS, AG = allreduce_parameter.run_reduce_scatter, allreduce_parameter.run_all_gather


@pytest.mark.slow
def test_bound_parameters_are_reduced_in_place_with_the_seed_bits() -> None:
    run_ranks(views_job, 2, free_port(), timeout=120)


def test_one_rank_holds_all_weights_only_in_its_own_flat_weights() -> None:
    """A world of one publishing in place: ``get_weights`` into the flat weights
    would move nothing (the ``sharded`` strategy then skips it); into anything
    else, or with a codec (the wire holds encoded values), it would."""
    model = make_model()
    params = list(model.parameters())
    n = sum(q.numel() for q in params)
    with local_group(0, 1, free_port(), timeout=60) as group:
        with AllReduceParameter(n, group=group) as plain:
            plain.init(params)
            assert not plain.holds_all_weights(torch.zeros(n))  # nothing handed out yet
            plain.bind(params)
            assert plain.holds_all_weights(plain.flat_weights)
            assert not plain.holds_all_weights(plain.flat_weights.clone())
            assert not plain.holds_all_weights(plain.flat_weights[1:])
            before = plain.flat_weights.clone()
            plain.get_weights(plain.flat_weights).wait()  # what skipping it leaves out
            assert torch.equal(plain.flat_weights, before)
        with AllReduceParameter(n, group=group, compress="bf16") as coded:
            coded.init([q.detach().clone() for q in params])
            assert not coded.holds_all_weights(coded.flat_weights)
