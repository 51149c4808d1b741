"""The transport interface on real processes: every transport through `begin`.

One 3-rank job runs the shared-memory, ring and backend ("gloo") transports
side by side on one process group (a wrapper each), plus a 1-rank group per
rank (the single-rank transport), and checks what the interface promises:
broadcast gives the root's bits for any dtype and size (empty included),
``Transport.all_reduce`` gives the bits of the public reduce-scatter +
all-gather, and a group takes the transport it asked for. A second job kills
the shared-memory leader during set-up: its peer names it.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradhub import codecs
from gradhub.collective import CollectiveGroup, all_gather, all_reduce, local_group, reduce_scatter
from gradhub.errors import ClosedError, WorkerFailedError
from gradhub.transports import Chunking, begin, chosen
from gradhub.transports.shm import supported
from harness import free_port, run_ranks

BROADCASTS = [
    (torch.float32, 1001, 0),
    (torch.int64, 7, 2),
    (torch.uint8, 0, 1),
    (torch.bfloat16, 13, 2),
    (torch.float64, 300_001, 1),  # 2.4 MB: the shared segment grows
]


def values(dtype: torch.dtype, numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g) * (1 + seed)).to(dtype)
    return torch.randint(0, 100, (numel,), generator=g).to(dtype)


def on_worker(group: CollectiveGroup, name: str, body: Any) -> Any:
    """Run ``body(transport, op)`` as one operation on the group's worker thread."""

    def run() -> Any:
        op, transport = begin(group, name)
        return body(transport, op)

    return group.submit(name, run).wait()


def job(rank: int, world_size: int, port: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    with local_group(rank, world_size, port, timeout=60, transport="ring") as ring:
        groups = {"ring": ring, "shm": ring.sibling(), "gloo": ring.sibling()}
        groups["shm"].transport, groups["gloo"].transport = "shm", "gloo"
        for name, group in groups.items():
            for dtype, numel, root in BROADCASTS:
                mine = values(dtype, numel, seed=rank)
                on_worker(group, "broadcast", lambda t, op: t.broadcast(op, mine, root))  # noqa: B023
                out[f"{name}/broadcast/{dtype}/{numel}"] = torch.equal(
                    mine, values(dtype, numel, seed=root)
                )
            for codec in ("none", "bf16"):
                c = codecs.get(codec)
                x = values(torch.float32, 100_003, seed=rank)
                expected = all_gather(
                    reduce_scatter(x, group=group, compress=c),
                    x.numel(),
                    group=group,
                    compress=c,
                )
                y = x.clone()
                on_worker(group, "all_reduce", lambda t, op: t.all_reduce(op, y, c, Chunking()))  # noqa: B023
                # gloo's own all_reduce sums in its order: compare within fp32 rounding
                same = torch.equal if name != "gloo" else torch.allclose
                out[f"{name}/all_reduce/{codec}"] = bool(same(y, expected))
            out[f"{name}/chosen"] = chosen(group)
        shm = on_worker(groups["shm"], "keep", lambda t, op: (t, op))
        for name in ("shm", "gloo"):
            groups[name].close()
        try:  # the transport was closed with its group
            shm[0].broadcast(shm[1], torch.zeros(3), 0)
        except ClosedError as exc:
            out["closed"] = str(exc)
        # A group of one rank: the single-rank transport, whatever was asked.
        singles = [dist.new_group([r]) for r in range(world_size)]
        with CollectiveGroup(singles[rank], store=None, timeout=60, transport="shm") as one:
            x = values(torch.float32, 11, seed=rank)
            y = x.clone()
            on_worker(
                one, "all_reduce", lambda t, op: t.all_reduce(op, y, codecs.get("bf16"), Chunking())
            )
            out["single/all_reduce"] = torch.equal(
                y, codecs.get("bf16").decode(codecs.get("bf16").encode(x))
            )
            on_worker(one, "broadcast", lambda t, op: t.broadcast(op, y, 0))
            out["single/chosen"] = chosen(one)
    return out


@pytest.mark.slow
@pytest.mark.skipif(not supported(), reason="needs memfd, pidfd and futex")
def test_every_transport_keeps_the_interface() -> None:
    results = run_ranks(job, 3, free_port(), timeout=180)
    for r in results:
        failed = [k for k, v in r.value.items() if v is False]
        assert failed == [], (r.rank, failed)
        assert "shared-memory transport is closed" in r.value.pop("closed"), r.value
        chosen_names = {k: v for k, v in r.value.items() if k.endswith("chosen")}
        assert chosen_names == {
            "ring/chosen": "ring",
            "shm/chosen": "shm",
            "gloo/chosen": "gloo",
            "single/chosen": "single",
        }


def leader_dies_job(rank: int, world_size: int, port: int) -> str:
    torch.set_num_threads(1)
    # The store lives in the test process, so the leader's death leaves it standing.
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    group = CollectiveGroup(
        dist.group.WORLD, store=store, timeout=20, owns_process_group=True, transport="shm"
    )
    if rank == 0:  # the shared-memory leader: killed after it listens, before it hands out fds
        from gradhub.transports import shm_setup

        def die(*args: object) -> int:
            os.kill(os.getpid(), signal.SIGKILL)
            return -1

        shm_setup.new_segment = die  # type: ignore[assignment] (this process only)
    try:
        all_reduce(torch.ones(10), group=group).wait()
    except WorkerFailedError as exc:
        return str(exc)
    finally:
        group.close()
    return "no error"


@pytest.mark.slow
@pytest.mark.skipif(not supported(), reason="needs memfd, pidfd and futex")
def test_a_leader_lost_during_set_up_is_named() -> None:
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, wait_for_workers=False)
    results = run_ranks(leader_dies_job, 2, port, timeout=120, check=False)
    del store
    assert results[0].exitcode == -signal.SIGKILL
    assert results[1].ok, results[1].error
    assert "rank 0" in results[1].value and "set-up" in results[1].value, results[1].value
