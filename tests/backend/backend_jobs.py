"""Rank functions for the backend's multi-process tests (module-level, importable)."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import gradhub

R = dist.ReduceOp


def init(rank: int, world_size: int, backend: str = "gradhub", timeout: float = 60.0) -> None:
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )


def _data(rank: int, dtype: torch.dtype, n: int = 1000) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    if dtype.is_floating_point:
        return (torch.randn(n, generator=g) * 10).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def operations_match_gloo(rank: int, world_size: int) -> dict[str, Any]:
    """Every operation on the gradhub group against the same one on a gloo group."""
    init(rank, world_size)
    gloo = dist.new_group(backend="gloo")
    sub = dist.new_group(backend="gradhub")
    checked: list[str] = []

    def same(name: str, run: Any) -> None:
        a, b = run(None), run(gloo)
        for x, y in zip(a, b, strict=True):
            assert x.dtype == y.dtype and torch.equal(x.view(-1), y.view(-1)), name
        checked.append(name)

    floats = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
    ints = [torch.int32, torch.int64, torch.uint8, torch.int8]
    for dt in floats + ints:
        ops_ = [R.SUM, R.MAX, R.MIN, R.PRODUCT] + ([R.AVG] if dt.is_floating_point else [])
        ops_ += [] if dt.is_floating_point else [R.BAND, R.BOR, R.BXOR]
        for op in ops_:
            if op == R.PRODUCT and dt in (torch.float16, torch.bfloat16):
                continue

            def ar(g: Any, dt: torch.dtype = dt, op: Any = op) -> list[torch.Tensor]:
                t = _data(rank, dt)
                dist.all_reduce(t, op=op, group=g)
                return [t]

            same(f"all_reduce {dt} {op}", ar)

    for op in (R.SUM, R.MAX, R.PRODUCT):

        def coalesced(g: Any, op: Any = op) -> list[torch.Tensor]:
            ts = [_data(rank + i, torch.float32, 10 + i) for i in range(3)]
            dist.all_reduce_coalesced(ts, op=op, group=g)
            return ts

        same(f"all_reduce_coalesced {op}", coalesced)

    def strided(g: Any) -> list[torch.Tensor]:
        base = _data(rank, torch.float32, 2000).view(40, 50)
        t = base.t()  # not contiguous
        dist.all_reduce(t, group=g)
        return [base]

    same("all_reduce non-contiguous", strided)

    def bcast(g: Any) -> list[torch.Tensor]:
        out = []
        for dt in (torch.float32, torch.int64, torch.bfloat16):
            t = _data(rank, dt)
            dist.broadcast(t, src=world_size - 1, group=g)
            out.append(t)
        return out

    same("broadcast", bcast)

    for dt in (torch.float32, torch.int64, torch.float16, torch.bfloat16):

        def ag(g: Any, dt: torch.dtype = dt) -> list[torch.Tensor]:
            t = _data(rank, dt, 10)
            outs = [torch.empty_like(t) for _ in range(world_size)]
            dist.all_gather(outs, t, group=g)
            single = torch.empty(world_size * 10, dtype=dt)
            dist.all_gather_into_tensor(single, t, group=g)
            return [*outs, single]

        same(f"all_gather {dt}", ag)

        def rs(g: Any, dt: torch.dtype = dt) -> list[torch.Tensor]:
            chunks = [_data(rank + 7 * i, dt, 12) for i in range(world_size)]
            out = torch.empty(12, dtype=dt)
            dist.reduce_scatter(out, chunks, group=g)
            single = torch.empty(12, dtype=dt)
            dist.reduce_scatter_tensor(single, torch.cat(chunks), group=g)
            return [out, single]

        same(f"reduce_scatter {dt}", rs)

    def rs_avg(g: Any) -> list[torch.Tensor]:
        inp = _data(rank, torch.float32, 12 * world_size)
        out = torch.empty(12)
        dist.reduce_scatter_tensor(out, inp, op=R.AVG, group=g)
        return [out]

    same("reduce_scatter AVG", rs_avg)

    def rs_read_in_place(g: Any) -> list[torch.Tensor]:
        # The transport reads the input where it lies: it must stay unchanged,
        # PREMUL_SUM included, and an output that is this rank's own chunk of
        # the input (an in-place reduce-scatter) must get the sum.
        inp = _data(rank, torch.float32, 12 * world_size)
        before = inp.clone()
        out, scaled = torch.empty(12), torch.empty(12)
        dist.reduce_scatter_tensor(out, inp, group=g)
        if g is None:
            dist.reduce_scatter_tensor(scaled, inp, op=dist._make_nccl_premul_sum(0.5), group=g)
        else:  # gloo has no PREMUL_SUM: scale a copy first, as the backend does
            dist.reduce_scatter_tensor(scaled, inp * 0.5, group=g)
        assert torch.equal(inp, before), "reduce_scatter_tensor changed its input"
        own = inp.view(world_size, 12)[rank]
        if g is None:
            dist.reduce_scatter_tensor(own, inp, group=g)
        else:  # the reference: out of place, copied into the chunk
            ref = torch.empty(12)
            dist.reduce_scatter_tensor(ref, inp, group=g)
            own.copy_(ref)
        return [out, scaled, inp]

    same("reduce_scatter_tensor reads its input in place", rs_read_in_place)

    def coalesced_views(g: Any) -> list[torch.Tensor]:
        # Tensors back to back in one storage are reduced where they lie.
        base = _data(rank, torch.float32, 30)
        dist.all_reduce_coalesced([base[:10], base[10:25], base[25:]], group=g)
        return [base]

    same("all_reduce_coalesced of adjacent views", coalesced_views)

    def a2a(g: Any) -> list[torch.Tensor]:
        inp = _data(rank, torch.float32, 4 * world_size)
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp, group=g)
        outs = [torch.empty(3) for _ in range(world_size)]
        dist.all_to_all(
            outs, [_data(rank + i, torch.float32, 3) for i in range(world_size)], group=g
        )
        return [out, *outs]

    same("all_to_all", a2a)

    def rooted(g: Any) -> list[torch.Tensor]:
        t = _data(rank, torch.float32, 8)
        dist.reduce(t, dst=0, group=g)
        gathered = [torch.zeros(8) for _ in range(world_size)] if rank == 0 else None
        dist.gather(_data(rank, torch.float32, 8), gathered, dst=0, group=g)
        s = torch.zeros(5)
        dist.scatter(
            s,
            [_data(i, torch.float32, 5) for i in range(world_size)] if rank == 0 else None,
            src=0,
            group=g,
        )
        return [t if rank == 0 else torch.zeros(0), *(gathered or []), s]

    same("reduce gather scatter", rooted)

    def objects(g: Any) -> list[torch.Tensor]:
        objs: list[Any] = [None] * world_size
        dist.all_gather_object(objs, {"rank": rank, "x": [rank] * 3}, group=g)
        assert objs == [{"rank": r, "x": [r] * 3} for r in range(world_size)]
        lst = [f"hello {rank}"]
        dist.broadcast_object_list(lst, src=0, group=g)
        assert lst == ["hello 0"]
        return []

    same("object collectives", objects)

    # point to point, both directions
    peer = (rank + 1) % world_size
    prev = (rank - 1) % world_size
    t = torch.full((5,), float(rank))
    got = torch.empty(5)
    reqs = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, got, prev)]
    )
    for q in reqs:
        q.wait()
    assert torch.equal(got, torch.full((5,), float(prev)))
    checked.append("send/recv")

    # async work: wait(timeout) and get_future()
    x = torch.ones(4)
    work = dist.all_reduce(x, async_op=True)
    assert work.wait(timedelta(seconds=30))
    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    value = fut.wait()
    assert isinstance(value, list) and torch.equal(value[0], torch.full((4,), float(world_size)))
    checked.append("work")

    # the sub-group from new_group(backend="gradhub")
    y = torch.full((3,), float(rank + 1))
    dist.all_reduce(y, group=sub)
    assert torch.equal(y, torch.full((3,), float(sum(range(1, world_size + 1)))))
    assert dist.get_backend(sub) == "gradhub"
    checked.append("new_group")
    dist.barrier()
    assert dist.group.WORLD.transport == "shm"  # type: ignore[union-attr]

    # barrier: nobody leaves before the last enters, behind the calls before it;
    # with a timeout of its own (gloo's barrier then) too
    import time

    late = world_size - 1
    pending = dist.all_reduce(torch.ones(4), async_op=True)
    begin = time.monotonic()
    if rank == late:
        time.sleep(0.5)
    dist.barrier()
    waited = time.monotonic() - begin
    assert pending.is_completed()
    assert rank == late or waited >= 0.4, f"rank {rank} left the barrier after {waited:.2f}s"
    dist.barrier(timeout=timedelta(seconds=30))
    checked.append("barrier")

    # a CUDA tensor is a typed error pointing to NCCL
    try:
        dist.all_reduce(torch.ones(2, device="meta"))
    except gradhub.errors.CollectiveArgumentError as exc:
        assert "NCCL" in str(exc)
        checked.append("device error")
    # a message that never comes: recv fails within the group's timeout, naming the peer
    quiet = dist.new_group(backend="gradhub", timeout=timedelta(seconds=2))
    if rank == 0:
        try:
            dist.recv(torch.empty(3), src=1, group=quiet)
        except gradhub.errors.CollectiveTimeoutError as exc:
            assert "rank(s) 1" in str(exc), str(exc)
            checked.append("silent peer named")
    dist.barrier()

    # a stalled peer: the operation fails within the group's timeout, naming it
    lone = dist.new_group(backend="gradhub", timeout=timedelta(seconds=2))
    dist.all_reduce(torch.ones(8), group=lone)  # transports set up
    begin = time.monotonic()
    try:
        if rank == late:
            time.sleep(3)
        dist.barrier(group=lone)
    except gradhub.errors.CollectiveTimeoutError as exc:
        assert rank != late and f"barrier timed out after 2s waiting for rank(s) {late}" in str(exc)
        assert time.monotonic() - begin < 3, "not within the group's timeout"
        checked.append("stalled barrier named")
    except gradhub.GradhubError:
        assert rank == late  # the late rank finds the others gone
    short = dist.new_group(backend="gradhub", timeout=timedelta(seconds=3))
    dist.all_reduce(torch.ones(8), group=short)  # transports set up
    begin = time.monotonic()
    if rank == world_size - 1:
        time.sleep(6)
    try:
        dist.all_reduce(torch.ones(1000), group=short)
    except gradhub.errors.CollectiveTimeoutError as exc:
        assert rank != world_size - 1 and f"rank(s) {world_size - 1}" in str(exc), str(exc)
        assert time.monotonic() - begin < 6, "not within the group's timeout"
        checked.append("stalled peer named")
    except gradhub.GradhubError:
        assert rank == world_size - 1  # the late rank finds the others gone
    dist.destroy_process_group()
    return {"checked": checked}
