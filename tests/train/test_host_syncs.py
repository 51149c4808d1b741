"""No host synchronisation in a training step, as under DDP.

On a GPU, reading a flag, count or norm back from a device tensor stalls the
host until the device has caught up. The rule, held here on CPU so that CI
checks it without a GPU: in a steady-state step under every strategy, torch's
profiler sees as many ``aten::item`` / ``aten::_local_scalar_dense`` calls as
under DDP (none), and no Python-level read of a tensor happens inside the
step, except where a parameter-server payload is written to the wire
(``gradhub/ps/protocol``): that data must reach the host to be sent.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.launch import ServerHandle, start_server
from harness import run_ranks
from host_sync_jobs import count_reads, steady_step_reads

_PAYLOAD = "gradhub/ps/wire/protocol/"  # a push's bytes on their way to the wire


def _reads_inside_the_step(reads: dict[str, int]) -> dict[str, int]:
    return {where: n for where, n in reads.items() if _PAYLOAD not in where}


def test_the_counter_sees_device_and_python_reads() -> None:
    # The counter must see what it is there to catch, or the tests below prove nothing.
    import torch

    t = torch.ones(3)
    device, python = count_reads(lambda: (bool(t.sum() > 0), float(t[0]), t.tolist()), steps=1)
    assert device >= 2  # bool and float dispatch to item
    assert sum(python.values()) == 3


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerHandle]]:
    modes = {"ps-sync": {"mode": "sync"}, "ps-async": {}, "ps-ssp": {"mode": "ssp"}}
    handles = {}
    try:
        for name, extra in modes.items():
            config = ServerConfig(workers=2, optimizer="sgd", lr=0.1, **extra)  # type: ignore[arg-type]
            handles[name] = start_server(config, in_thread=True)
        yield handles
    finally:
        for handle in handles.values():
            handle.close()


@pytest.mark.slow
@pytest.mark.parametrize("samples", [False, True], ids=["plain loop", "set_samples"])
@pytest.mark.parametrize(
    "strategy", ["DDP", "allreduce", "sharded", "ps-sync", "ps-async", "ps-ssp", "diloco"]
)
def test_a_steady_state_step_reads_nothing_back(
    strategy: str, samples: bool, servers: dict[str, ServerHandle]
) -> None:
    if samples and strategy == "DDP":
        pytest.skip("DDP has no set_samples")
    options = {"servers": [servers[strategy].address]} if strategy in servers else {}
    if strategy == "diloco":
        options = {"inner_steps": 2}  # of the two steps counted, the first is a sync
    results = run_ranks(steady_step_reads, 2, strategy, options, samples, timeout=90)
    for r in results:
        device, python = r.value
        assert device == 0, f"rank {r.rank}: {device} aten::item calls; reads: {python}"
        assert _reads_inside_the_step(python) == {}, f"rank {r.rank}"
