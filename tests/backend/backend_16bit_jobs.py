"""Rank functions: 16-bit collectives and broadcast on gradhub's transports, against gloo."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from backend_jobs import init

R = dist.ReduceOp
SIXTEEN = (torch.bfloat16, torch.float16)
LARGE = 2_200_000
"""Elements of a vector past SMALL_BYTES (4 MiB) in 16 bits: the size at which
the transports would take their point-to-point path for a lossy codec."""
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def values(rank: int, dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    """``n`` values of ``dtype`` for ``rank``; the first ones where 16-bit sums
    round visibly: ties to even, overflow to inf, subnormals, opposite signs."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(n, generator=g) * 10
    big = 65504.0 if dtype == torch.float16 else 3.3e38
    tiny = 2.0**-24 if dtype == torch.float16 else 2.0**-133
    tie = 2.0**-11 if dtype == torch.float16 else 2.0**-8
    edges = [big, -big, big / 2, tiny * (2 * rank + 1), 1.0 if rank == 0 else tie, -0.0]
    edges += [3.0 * (rank + 1), -(2.0 ** (rank - 3)), 1 / 3 + rank]
    k = min(n, len(edges))
    x[:k] = torch.tensor(edges[:k])
    return x.to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern (so -0.0 and 0.0 differ, inf compares)."""
    if t.dtype.itemsize == 2:
        return t.contiguous().reshape(-1).view(torch.int16)
    return t.contiguous().reshape(-1).view(torch.uint8)


def _premul(factor: float) -> Any:
    return dist._make_nccl_premul_sum(factor)


def _cases(rank: int, world: int) -> dict[str, Callable[[Any], list[torch.Tensor]]]:
    """Each case runs on the gradhub group (``None``) or the gloo group; gloo has
    no PREMUL_SUM, so its reference multiplies in the dtype first (as gradhub does)."""
    cases: dict[str, Callable[[Any], list[torch.Tensor]]] = {}
    for dt in SIXTEEN:
        for n in (1000, LARGE):
            for op_name, op in (("SUM", R.SUM), ("AVG", R.AVG), ("PREMUL", None)):

                def ar(g: Any, dt: Any = dt, n: int = n, op: Any = op) -> list[torch.Tensor]:
                    t = values(rank, dt, n)
                    if op is None and g is None:
                        dist.all_reduce(t, op=_premul(0.3), group=g)
                    elif op is None:
                        t.mul_(0.3)
                        dist.all_reduce(t, group=g)
                    else:
                        dist.all_reduce(t, op=op, group=g)
                    return [t]

                cases[f"all_reduce {dt} {n} {op_name}"] = ar

            def rs(g: Any, dt: Any = dt, n: int = n) -> list[torch.Tensor]:
                inp = values(rank, dt, n * world, seed=1)
                out, avg = torch.empty(n, dtype=dt), torch.empty(n, dtype=dt)
                dist.reduce_scatter_tensor(out, inp, group=g)
                dist.reduce_scatter_tensor(avg, inp, op=R.AVG, group=g)
                listed = torch.empty(n, dtype=dt)
                dist.reduce_scatter(listed, list(inp.chunk(world)), group=g)
                return [out, avg, listed]

            cases[f"reduce_scatter {dt} {n}"] = rs

            def ag(g: Any, dt: Any = dt, n: int = n) -> list[torch.Tensor]:
                t = values(rank, dt, n, seed=2)
                single = torch.empty(n * world, dtype=dt)
                dist.all_gather_into_tensor(single, t, group=g)
                listed = [torch.empty_like(t) for _ in range(world)]
                dist.all_gather(listed, t, group=g)
                return [single, *listed]

            cases[f"all_gather {dt} {n}"] = ag

        def coalesced(g: Any, dt: Any = dt) -> list[torch.Tensor]:
            ts = [values(rank, dt, 10 + i, seed=3 + i) for i in range(3)]
            dist.all_reduce_coalesced(ts, group=g)
            return ts

        cases[f"all_reduce_coalesced {dt}"] = coalesced

        def strided(g: Any, dt: Any = dt) -> list[torch.Tensor]:
            base = values(rank, dt, 2000, seed=6).view(40, 50)
            dist.all_reduce(base.t(), group=g)
            out = torch.empty(20, 50, dtype=dt)
            inp = values(rank, dt, 1000 * world, seed=8).view(50 * world, 20)
            dist.reduce_scatter_tensor(out.t(), inp, group=g)
            return [base, out]

        cases[f"non-contiguous {dt}"] = strided

    def bcast(g: Any) -> list[torch.Tensor]:
        out = []
        g_ = torch.Generator().manual_seed(rank)
        for dt in (torch.float32, *SIXTEEN, torch.float64, torch.int64, torch.int32):
            for root in range(world):
                t = (torch.randn(100, generator=g_) * 100).to(dt)
                dist.broadcast(t, src=root, group=g)
                out.append(t)
        for dt in (torch.int8, torch.uint8, torch.bool):
            t = (torch.arange(64) * (rank + 3)).to(dt)
            dist.broadcast(t, src=world - 1, group=g)
            out.append(t)
        big = values(rank, torch.bfloat16, LARGE)
        dist.broadcast(big, src=0, group=g)
        base = values(rank, torch.float32, 600).view(20, 30)
        dist.broadcast(base.t(), src=world - 1, group=g)  # not contiguous
        scalar, empty = torch.tensor(float(rank)), torch.empty(0)
        dist.broadcast(scalar, src=world - 1, group=g)
        dist.broadcast(empty, src=0, group=g)
        return [*out, big, base, scalar, empty]

    cases["broadcast"] = bcast
    return cases


def sixteen_bit_match_gloo(rank: int, world: int, transport: str) -> dict[str, Any]:
    """Every case on the gradhub group gives gloo's bits (two ranks)."""
    if transport != "auto":
        os.environ["GRADHUB_TRANSPORT"] = transport
    init(rank, world)
    gloo = dist.new_group(backend="gloo")
    checked = []
    for name, run in _cases(rank, world).items():
        ours, theirs = run(None), run(gloo)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert a.dtype == b.dtype and a.shape == b.shape, f"{name} [{i}]"
            assert torch.equal(bits(a), bits(b)), f"{name} [{i}]: not gloo's bits"
        checked.append(name)
    chosen = dist.group.WORLD.transport  # type: ignore[union-attr]
    dist.destroy_process_group()
    return {"checked": checked, "transport": chosen}


def sixteen_bit_within_bound(rank: int, world: int, per_host: int) -> dict[str, Any]:
    """With more than two ranks gloo rounds every partial 16-bit sum, gradhub once:
    both within the bound stated in gradhub.backend.operations, of each other
    and of the exact sum; every rank ends with the same bits."""
    os.environ["GRADHUB_HOST_ID"] = f"host-{rank // per_host}"
    init(rank, world)
    gloo = dist.new_group(backend="gloo")
    checked = []
    for dt in SIXTEEN:
        u = UNIT_ROUNDOFF[dt]
        for n in (1000, LARGE):
            x = values(rank, dt, n)
            everyone = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(everyone, x, group=gloo)
            wide = torch.stack([e.double() for e in everyone])
            exact, magnitude = wide.sum(0), wide.abs().sum(0)
            finite = magnitude.to(dt).isfinite()  # gloo may overflow where we do not
            ours, theirs = x.clone(), x.clone()
            dist.all_reduce(ours)
            dist.all_reduce(theirs, group=gloo)
            apart = (ours.double() - theirs.double()).abs()[finite]
            bound = ((world * u + 2 * (world - 1) * 2.0**-24) * magnitude)[finite]
            assert bool((apart <= bound).all()), f"{dt} {n}: gloo and gradhub too far apart"
            error = (ours.double() - exact).abs()[finite]
            own = (u * exact.abs() + (world - 1) * 2.0**-24 * magnitude)[finite]
            assert bool((error <= own).all()), f"{dt} {n}: off the exact sum"
            results = [torch.empty_like(ours) for _ in range(world)]
            dist.all_gather(results, ours, group=gloo)
            assert all(torch.equal(bits(r), bits(ours)) for r in results), f"{dt} {n}: ranks"
            checked.append(f"{dt} {n}")
    chosen = dist.group.WORLD.transport  # type: ignore[union-attr]
    dist.destroy_process_group()
    return {"checked": checked, "transport": chosen}
