"""A surviving job across two emulated hosts (tests/cluster.py: network
namespaces joined by 1 Gbit/s links), 2 workers each, started as on real
machines: the same ``gradhub run --survive`` with torchrun's multi-node
options on each host. Both workers of host 1 kill themselves in the same
step's backward; host 1's launcher reports their deaths to node 0's, which
keeps the membership; host 0's workers finish with the single process's
parameters (within 1e-5, as in test_survive.py). Skipped without root.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster import Cluster

JOB = str(Path(__file__).with_name("survive_job.py"))
GRADHUB = str(Path(sys.executable).with_name("gradhub"))

_why = Cluster.unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"emulated cluster: {_why}")


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("strategy", ["allreduce", "sharded"])
def test_one_hosts_workers_killed_together_the_other_host_finishes(
    tmp_path: Path, strategy: str
) -> None:
    """Under ``sharded`` every slice's mirror is on the other host: none is lost."""
    ref = tmp_path / "reference"
    subprocess.run([sys.executable, JOB, "--out", str(ref)], check=True, timeout=300)
    want = torch.load(ref / "member-0.pt")
    out = tmp_path / "job"
    kills = ["--strategy", strategy, "--kill", "2:5:backward", "--kill", "3:5:backward"]
    with Cluster(2, rate="1gbit", gloo_ifname=False) as c:
        endpoint = f"{c.hosts[0].addr}:29611"
        procs, logs = [], []
        for node in range(2):
            logs.append(tmp_path / f"node{node}.log")
            argv = [GRADHUB, "run", "-n", "2", "--survive", "--nnodes", "2"]
            argv += ["--node-rank", str(node), "--rdzv-endpoint", endpoint]
            with logs[-1].open("w") as log:
                procs.append(
                    c.popen(
                        node,
                        [*argv, JOB, "--out", str(out), *kills],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=str(tmp_path),
                        text=True,
                    )
                )
        codes = [p.wait(360) for p in procs]
    text = "\n".join(f"--- {log.name}\n{log.read_text()[-4000:]}" for log in logs)
    assert codes == [0, 0], text
    reports = {
        int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in out.glob("member-*.json")
    }
    assert sorted(reports) == [0, 1], text
    first = torch.load(out / "member-0.pt")
    for member, report in reports.items():
        assert report["pid_start"] == report["pid_end"]
        assert (report["committed_steps"], report["world_size"]) == (32, 2)
        got = torch.load(out / f"member-{member}.pt")
        for name, value in got.items():
            assert torch.equal(value, first[name])
            assert (value - want[name]).abs().max().item() <= 1e-5, name
        assert report["result"]["failures"] == 2
