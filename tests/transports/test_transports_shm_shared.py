"""Vectors the shared-memory transport reads in place (``ShmTransport.shared_vector``).

Real processes. Some ranks hand the transport their shared vector, others a
private tensor, in the same operation: every rank must get the bits that
private tensors everywhere give. A reader is slowed down on purpose, and the
ranks that exposed their vector overwrite it the moment the operation
returns: the operation must not return before every rank has read it.
"""

from __future__ import annotations

import time

import pytest
import torch

from gradhub.collective import all_gather, local_group, reduce_scatter
from gradhub.collective.collectives import run_shared_vectors
from gradhub.transports import shm
from harness import free_port, run_ranks

pytestmark = pytest.mark.skipif(not shm.supported(), reason="needs memfd, pidfd and futex")

N = 100_003


def shared_job(rank: int, world_size: int, port: int) -> list[str]:
    torch.set_num_threads(1)
    if rank == 0:  # the slow reader: reads the others' values 0.2 s late
        sources = shm.ShmTransport._sources

        def slow(self: shm.ShmTransport, k: int, regions: list[torch.Tensor]) -> list[torch.Tensor]:
            time.sleep(0.2)
            return sources(self, k, regions)

        shm.ShmTransport._sources = slow  # type: ignore[method-assign]
    failures = []
    with local_group(rank, world_size, port, timeout=60, transport="shm") as g:
        vectors = g.submit("vectors", lambda: run_shared_vectors(g, 1, N, name="vectors")).wait()
        assert vectors is not None
        vector = vectors[0]
        x = torch.randn(N, generator=torch.Generator().manual_seed(rank))
        expected_rs = reduce_scatter(x, group=g)  # private tensors everywhere
        expected_ag = all_gather(expected_rs, N, group=g)
        for exposing in ({1}, {0, 2}, set(range(world_size))):
            mine = rank in exposing
            source = vector if mine else torch.empty(N)
            source.copy_(x)
            summed = reduce_scatter(source, group=g)
            if mine:
                source.fill_(float("nan"))  # at once: nobody may read it any more
            if not torch.equal(summed, expected_rs):
                failures.append(f"reduce_scatter, exposing {sorted(exposing)}")
            target = vector if mine else torch.empty(N)
            all_gather(summed, N, group=g, out=target)
            gathered = target.clone()
            if mine:
                target.fill_(float("nan"))
            if not torch.equal(gathered, expected_ag):
                failures.append(f"all_gather, exposing {sorted(exposing)}")
    return failures


@pytest.mark.slow
def test_vectors_read_in_place_give_the_private_bits() -> None:
    results = run_ranks(shared_job, 3, free_port(), timeout=120)
    assert [r.value for r in results] == [[], [], []], results


def test_a_view_of_a_segment_outlives_the_mapping_s_close() -> None:
    # The transport closes its mappings with the group; a tensor still viewing one
    # (a model's parameters bound to an AllReduceParameter's flat buffers) must
    # keep reading valid memory, not unmapped pages.
    from gradhub._shm.memory import Mapping, new_segment

    mapping = Mapping(new_segment(1 << 16, "gradhub-test"), 1 << 16)
    assert mapping.bytes is not None
    view = mapping.bytes[:64].view(torch.float32)
    view.fill_(2.5)
    mapping.close()
    view.add_(1.0)  # unmapped memory would end the process here (SIGSEGV)
    assert torch.equal(view, torch.full((16,), 3.5))
