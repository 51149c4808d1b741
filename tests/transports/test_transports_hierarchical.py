"""Transports across hosts on real processes, hosts faked with GRADHUB_HOST_ID.

4 ranks as 2 "hosts" x 2 ranks on this machine take the hierarchical path
(the shared memory inside a host is real; the ring between hosts runs over
loopback), also for the ``allreduce`` strategy's bf16 buckets, and name a
rank killed in it; as 4 hosts x 1 rank they take the flat ring. The emulated
cluster (test_multihost.py) runs the same paths across network namespaces,
with the flat ring forced by GRADHUB_TRANSPORT, and counts the bytes between
hosts.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from gradhub import codecs
from gradhub._shm.hosts import HostLayout
from gradhub.collective import all_gather, all_reduce, local_group, reduce_scatter
from gradhub.errors import WorkerFailedError
from gradhub.partition import partition_ranges
from gradhub.train import reducers
from gradhub.transports import choice as transport
from gradhub.transports import shm
from gradhub.transports.hierarchical import fits
from gradhub.transports.schedule import reduction_order
from harness import free_port, run_ranks
from train_helpers import counting_backend_all_reduce

pytestmark = pytest.mark.skipif(not shm.supported(), reason="needs memfd, pidfd and futex")

CODECS = ["none", "fp16", "bf16", "bf16-truncate"]
HOSTS = [[0, 1], [2, 3]]
# empty, 1, fewer elements than ranks, odd, and several pipelined messages
# per chunk (PIPELINE elements each).
SIZES = [0, 1, 3, 1001, 300_001]
PIPELINE = 1 << 16


def rank_values(size: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * size + rank)
    return torch.randn(size, generator=g) * (1 + rank)


def hierarchical_reference(size: int) -> torch.Tensor:
    """The fp32 sum in the hierarchical order (see gradhub.transports.hierarchical):
    each host's values folded in the local ring order of the slice's owner, then
    the host sums folded in the ring order between hosts."""
    values = [rank_values(size, r) for r in range(4)]
    out = torch.empty(size)
    for owner, (s, n) in enumerate(partition_ranges(size, 4)):
        host, index = divmod(owner, 2)
        sums = []
        for ranks in HOSTS:
            order = [ranks[j] for j in reduction_order(index, 2)]
            acc = values[order[0]][s : s + n].clone()
            for r in order[1:]:
                acc += values[r][s : s + n]
            sums.append(acc)
        hosts = reduction_order(host, 2)
        acc = sums[hosts[0]].clone()
        for h in hosts[1:]:
            acc += sums[h]
        out[s : s + n] = acc
    return out


def flat_reference(size: int) -> torch.Tensor:
    """The flat ring's fp32 sum (schedule.reduction_order over all 4 ranks)."""
    values = [rank_values(size, r) for r in range(4)]
    out = torch.empty(size)
    for owner, (s, n) in enumerate(partition_ranges(size, 4)):
        order = reduction_order(owner, 4)
        acc = values[order[0]][s : s + n].clone()
        for r in order[1:]:
            acc += values[r][s : s + n]
        out[s : s + n] = acc
    return out


def check(out: dict[str, torch.Tensor], rank: int) -> list[str]:
    """The keys of ``out`` that do not hold what they should (empty: all good)."""
    bad = []
    for size in SIZES:
        want = hierarchical_reference(size)
        exact = flat_reference(size)
        s, n = partition_ranges(size, 4)[rank]
        # fp32: exactly the stated order (host sums first), run to run.
        for key in ("none/out", "none/inplace", "all_reduce"):
            if not torch.equal(out[f"{size}/{key}"], want):
                bad.append(f"{size}/{key}")
        if not torch.equal(out[f"{size}/none/rs"], want[s : s + n]):
            bad.append(f"{size}/none/rs")
        # Against the flat ring's order: fp32 rounding of 3 additions of values
        # up to ~4 * 4.5 (randn * (1 + rank)), i.e. a few ulps of ~20.
        if not torch.allclose(want, exact, rtol=0, atol=1e-5):
            bad.append(f"{size}/order")
        magnitude = sum(rank_values(size, r).abs() for r in range(4))
        for name in CODECS[1:]:
            # Two roundings to 16 bits: the other host's sum on its one hop
            # between the hosts, and the owner's sum in the all-gather; each is
            # off by less than one unit of the 16-bit format's last place
            # (relative 2**-7 for bf16, 2**-10 for fp16) of a value at most
            # sum(|g_r|); plus the fp32 reordering above.
            rel = 2**-7 if name.startswith("bf16") else 2**-10
            error = (out[f"{size}/{name}/out"] - exact).abs()
            if not bool((error <= 2 * rel * magnitude + 1e-5).all()):
                bad.append(f"{size}/{name}/out")
            if not torch.equal(out[f"{size}/{name}/out"], out[f"{size}/{name}/inplace"]):
                bad.append(f"{size}/{name}/inplace")
    return bad


def job(
    rank: int, world_size: int, port: int, ring_port: int, kill_port: int, folder: str
) -> dict[str, object]:
    torch.set_num_threads(1)
    os.environ["GRADHUB_HOST_ID"] = f"host-{rank // 2}"
    out: dict[str, torch.Tensor] = {}
    options = {"small_bytes": 0, "pipeline_elements": PIPELINE}
    with local_group(rank, world_size, port, timeout=60) as group:
        for size, name in itertools.product(SIZES, CODECS):
            x = rank_values(size, rank)
            start, length = partition_ranges(size, world_size)[rank]
            mine = reduce_scatter(x, group=group, compress=name, **options)
            full = all_gather(mine, size, group=group, compress=name, **options)
            y = x.clone()
            own = y[start : start + length]
            reduce_scatter(y, group=group, compress=name, out=own, **options)
            wire = own if name == "none" else codecs.get(name).encode(own)
            all_gather(wire, size, group=group, compress=name, out=y, **options)
            out[f"{size}/{name}/out"] = full
            out[f"{size}/{name}/inplace"] = y
            out[f"{size}/{name}/rs"] = mine
            if name == "none":
                z = x.clone()
                all_reduce(z, group=group).wait()  # default options: small vectors too
                out[f"{size}/all_reduce"] = z
        # The allreduce strategy's bf16 bucket reducer on this group: the same
        # hierarchical all-reduce (fp32 inside each host, bf16 between them),
        # none of it through gloo's own all_reduce.
        bucket = rank_values(SIZES[-1], rank)
        with counting_backend_all_reduce() as backend:
            reducers.make("bf16", collective=group).reduce(
                bucket, shapes=[bucket.shape], bucket_index=0, step=0
            )
        out["bucket/bf16"] = bucket
        chosen = transport.chosen(group)
    # One rank per host: the flat ring, with the bits of one host (shared memory
    # gives the ring's bits: test_transports_shm.py).
    os.environ["GRADHUB_HOST_ID"] = f"host-{rank}"
    with local_group(rank, world_size, ring_port, timeout=60) as group:
        flat = rank_values(SIZES[-1], rank)
        all_reduce(flat, group=group).wait()
        flat_chosen = transport.chosen(group)
    whole = sorted(k for k in out if not k.endswith("/rs"))  # slices differ by rank
    digest = hashlib.sha256(b"".join(out[k].numpy().tobytes() for k in whole))
    summary: dict[str, object] = {
        "chosen": chosen,
        "flat_chosen": flat_chosen,
        "flat_bits": torch.equal(flat, flat_reference(SIZES[-1])),
        "bad": check(out, rank),
        "bucket": torch.equal(bucket, out[f"{SIZES[-1]}/bf16/out"]) and not backend,
        "digest": digest.hexdigest(),
    }
    # Last, 2 x 2 again: rank 3 is killed (its summary saved first), the others
    # run an all-reduce without it.
    os.environ["GRADHUB_HOST_ID"] = f"host-{rank // 2}"
    group = local_group(rank, world_size, kill_port, timeout=20)
    x = torch.ones(100_000)
    all_reduce(x, group=group).wait()
    if rank == 3:
        Path(folder, "rank3.json").write_text(json.dumps(summary))
        os.kill(os.getpid(), signal.SIGKILL)
    begin = time.monotonic()
    with pytest.raises(WorkerFailedError) as info:
        all_reduce(x, group=group).wait()
    summary["elapsed"] = time.monotonic() - begin
    summary["error"] = str(info.value)
    group.close()
    return summary


def test_two_hosts_of_two_ranks_sum_each_host_first_and_name_a_killed_rank(
    tmp_path: Path,
) -> None:
    ports = [free_port() for _ in range(3)]
    ranks = run_ranks(job, 4, *ports, str(tmp_path), timeout=240, check=False)
    assert ranks[3].exitcode == -signal.SIGKILL
    for r in ranks[:3]:
        assert r.ok, r.error
        # Rank 2 shares rank 3's host (shared memory sees its process end);
        # ranks 0 and 1 are on the other host (rank 1's ring peer is rank 3,
        # rank 0's is rank 2, which leaves alive and answers the roll call).
        # On a loaded machine a live rank may answer the roll call too late and
        # be named beside rank 3; rank 3 must always be named.
        error = str(r.value["error"])
        named = re.search(r"rank\(s\) ([\d, ]+) died", error)
        assert "rank 3 (pid" in error or (named and "3" in named[1].split(", ")), error
        assert float(r.value["elapsed"]) < 15, r.value  # not the 20 s timeout
    results = [r.value for r in ranks[:3]] + [json.loads((tmp_path / "rank3.json").read_text())]
    for r in results:
        assert r["chosen"] == "hierarchical", r
        assert r["bad"] == [], r["bad"]
        assert r["bucket"], r  # the bf16 bucket reducer took the hierarchical path
        # 4 hosts x 1 rank: the flat ring, bit-identical to one host (one rank
        # per host is the layout the hierarchical path does not fit).
        assert r["flat_chosen"] == "ring" and r["flat_bits"], r
    # Every rank holds the same bits, for every codec, size and in/out of place.
    assert len({r["digest"] for r in results}) == 1


def test_which_layouts_fit_the_hierarchical_path() -> None:
    def layout(*hosts: str) -> HostLayout:
        return HostLayout.of(list(hosts), 0)

    assert fits(layout("a", "a", "b", "b"))
    assert fits(layout("a", "b", "a", "b"))  # interleaved ranks: columns are (0, 1), (2, 3)
    assert fits(layout("a", "a", "a", "b", "b", "b"))
    assert not fits(layout("a", "a", "a", "a"))  # one host: shared memory alone
    assert not fits(layout("a", "b", "c", "d"))  # one rank per host: the ring
    assert not fits(layout("a", "a", "a", "b"))  # hosts of different sizes: the ring
