"""Ring reduce-scatter + all-gather on real processes (gloo on 127.0.0.1).

One spawned job per world size runs every (size, codec) case, to keep the
number of process start-ups low.
"""

from __future__ import annotations

import hashlib
import itertools

import pytest
import torch

from gradhub import codecs
from gradhub.collective import all_gather, local_group, reduce_scatter
from gradhub.partition import partition_ranges
from gradhub.transports import schedule
from harness import free_port, run_ranks

CODECS = ["none", "fp16", "bf16", "bf16-truncate"]
# small_bytes per path: 0 forces the point-to-point ring at every size;
# 1 << 40 forces the collective (all_to_all + all_gather) path.
PATHS = {"ring": 0, "collective": 1 << 40}


def sizes_for(world_size: int) -> list[int]:
    # size < world size included (empty slices), and an odd large size.
    return sorted({0, 1, 2, 7, 1000, 300_007, max(world_size - 1, 0)})


def rank_values(size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input; every process can rebuild every rank's input."""
    g = torch.Generator().manual_seed(1000 * size + rank)
    return torch.randn(size, generator=g) * (1 + rank)


def reference_in_ring_order(xs: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """The single-process sum, added in the ring's fixed order per chunk.

    fp32 addition is not associative, so the exact equality asserted for
    "none" only holds when the reference adds in the same order as the ring:
    chunk c is x[c+1] + x[c+2] + ... + x[c] (schedule.reduction_order).
    """
    size = xs[0].numel()
    out = torch.empty(size)
    for c, (s, n) in enumerate(partition_ranges(size, world_size)):
        order = schedule.reduction_order(c, world_size)
        acc = xs[order[0]][s : s + n].clone()
        for r in order[1:]:
            acc = acc + xs[r][s : s + n]
        out[s : s + n] = acc
    return out


def error_bound(xs: list[torch.Tensor], codec: codecs.Codec, world_size: int) -> torch.Tensor:
    """Per-element bound on |ring result - exact sum| for a lossy codec.

    The ring's reduce-scatter encodes a partial sum at each of the P-1 hops (the
    collective path encodes each contribution once, within the same bound) and the
    all-gather encodes the final sum once: P roundings, each at most
    relative_error times a partial sum, and every partial sum is at most
    sum(|x_i|). fp32 additions add P * 2**-24 * sum(|x_i|). fp16 divides by P
    before encoding, so values near 0 can fall into the subnormal range, whose
    absolute step 2**-24 (scaled back by P) is added per rounding.
    """
    magnitude = torch.stack([x.double().abs() for x in xs]).sum(0)
    bound = world_size * codec.relative_error * magnitude * 1.001
    bound += world_size * 2.0**-23 * magnitude
    if codec.name == "fp16":
        bound += world_size * world_size * 2.0**-24
    return bound


def ring_job(rank: int, world_size: int, port: int) -> dict[str, str]:
    torch.set_num_threads(1)
    digests: dict[str, str] = {}
    with local_group(rank, world_size, port, timeout=60, transport="ring") as group:
        for size in sizes_for(world_size):
            xs = [rank_values(size, r) for r in range(world_size)]
            reference = reference_in_ring_order(xs, world_size)
            exact = torch.stack([x.double() for x in xs]).sum(0)
            start, length = partition_ranges(size, world_size)[rank]
            for name, path in itertools.product(CODECS, PATHS):
                codec = codecs.get(name)
                small = PATHS[path]
                mine = reduce_scatter(xs[rank], group=group, compress=codec, small_bytes=small)
                assert mine.dtype == torch.float32 and mine.numel() == length
                full = all_gather(mine, size, group=group, compress=codec, small_bytes=small)
                if name == "none":
                    assert torch.equal(mine, reference[start : start + length]), (size, name)
                    assert torch.equal(full, reference), (size, name)
                else:
                    bound = error_bound(xs, codec, world_size)
                    err = (full.double() - exact).abs()
                    worst = float((err - bound).max()) if size else 0.0
                    assert worst <= 0, f"size {size} {name}: error exceeds bound by {worst}"
                # In place: out= is this rank's own slice of the input, then the
                # gather writes over the input; the same bits as out of place.
                x = xs[rank].clone()
                own = x[start : start + length]
                reduce_scatter(x, group=group, compress=codec, out=own, small_bytes=small)
                all_gather(own, size, group=group, compress=codec, out=x, small_bytes=small)
                assert torch.equal(x, full), (size, name, path)
                digests[f"{size}/{name}/{path}"] = hashlib.sha256(
                    full.numpy().tobytes()
                ).hexdigest()
        # Inputs are not modified, and out= is filled in place.
        x = rank_values(10, rank)
        before = x.clone()
        reduce_scatter(x, group=group)
        assert torch.equal(x, before)
        out = torch.full((10,), float("nan"))
        assert all_gather(_own(x, world_size, rank), 10, out=out) is out
    return digests


def _own(x: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    s, n = partition_ranges(x.numel(), world_size)[rank]
    return x[s : s + n]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reduce_scatter_all_gather_match_single_process_sum(world_size: int) -> None:
    results = run_ranks(ring_job, world_size, free_port(), timeout=150)
    digests = [r.value for r in results]
    # Bit-identical on every rank, for every size and codec.
    assert all(d == digests[0] for d in digests)
    assert len(digests[0]) == len(sizes_for(world_size)) * len(CODECS) * len(PATHS)


def nccl_job(rank: int, world_size: int, port: int) -> bool:
    with local_group(rank, world_size, port, backend="nccl", timeout=60) as group:
        for size in (1, 7, 1000, 1_000_003, max(world_size - 1, 1)):
            xs = [rank_values(size, r).cuda() for r in range(world_size)]
            exact = torch.stack([x.double() for x in xs]).sum(0)
            for name in CODECS:
                codec = codecs.get(name)
                full = all_gather(reduce_scatter(xs[rank], group=group, compress=codec), size)
                err = (full.double() - exact).abs()
                bound = error_bound([x.cpu() for x in xs], codec, world_size).to(err.device)
                assert bool((err <= bound + 1e-5 * bound.max()).all()), (size, name)
    return True


@pytest.mark.slow
@pytest.mark.gpu
def test_nccl_reduce_scatter_all_gather() -> None:
    world_size = min(torch.cuda.device_count(), 4)
    if world_size < 2:
        pytest.skip("the NCCL ring test needs 2 GPUs (NCCL refuses two ranks on one GPU)")
    run_ranks(nccl_job, world_size, free_port(), timeout=150)
