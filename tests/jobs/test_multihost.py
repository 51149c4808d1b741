"""Jobs across emulated hosts: network namespaces joined by 1 Gbit/s links (tests/cluster.py).

Every job here is started the way a user starts one on real machines: the
same ``gradhub run`` command with torchrun's multi-node options on every
host, nothing else (no ``--local-addr``, no ``is_host``, no
``GLOO_SOCKET_IFNAME``: ``gradhub run`` works them out; the clusters here are
built with ``gloo_ifname=False``, which keeps it out of every process started
inside). Skipped without root.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
GRADHUB = str(Path(sys.executable).with_name("gradhub"))
JOB = str(Path(__file__).with_name("multihost_job.py"))

_why = Cluster.unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"emulated cluster: {_why}")


def _wait_all(procs: list[subprocess.Popen[str]], logs: list[Path], timeout: float) -> None:
    """Wait for every node's launcher; on a failure or timeout show their logs."""
    try:
        codes = [p.wait(timeout) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [p.poll() for p in procs]
    if codes != [0] * len(procs):
        text = "\n".join(f"--- {log.name} ---\n{log.read_text()[-4000:]}" for log in logs)
        raise AssertionError(f"launcher exit codes {codes}\n{text}")


def _nodes(
    cluster: Cluster, argvs: list[list[str]], tmp: Path, name: str, timeout: float = 240
) -> None:
    logs = [tmp / f"{name}.node{i}.log" for i in range(len(argvs))]
    procs = []
    for i, argv in enumerate(argvs):
        with logs[i].open("w") as out:  # the child keeps its own copy of the descriptor
            procs.append(
                cluster.popen(
                    i, argv, stdout=out, stderr=subprocess.STDOUT, cwd=str(tmp), text=True
                )
            )
    _wait_all(procs, logs, timeout)


@pytest.mark.slow
def test_strategies_on_two_hosts_match_one_host_and_servers_need_the_secret(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret-for-this-test\n")
    two, one = tmp_path / "2x2", tmp_path / "1x4"
    two.mkdir()
    one.mkdir()
    server_opts = ["--ps-mode", "sync", "--ps-lr", "0.5", "--ps-momentum", "0.9"]
    with Cluster(3, rate="1gbit", gloo_ifname=False) as c:
        h0, h2 = c.hosts[0].addr, c.hosts[2].addr
        # ps-async's server on a host of its own, reachable only with the secret.
        serve = [
            GRADHUB,
            "serve",
            "--bind",
            f"tcp://{h2}:5555",
            "--secret-file",
            str(secret),
            "--mode",
            "async",
            "--workers",
            "4",
        ]  # fmt: skip (optimizer: the workers')
        with (tmp_path / "server.log").open("w") as out:
            c.popen(2, serve, stdout=out, stderr=subprocess.STDOUT)
        job = [JOB, "--out", str(two), "--strategies", "allreduce,sharded,ps-sync,ps-async",
               "--secret-file", str(secret), "--async-server", f"tcp://{h2}:5555",
               "--refused-check", "--flat", "--count-bytes", "eth0"]  # fmt: skip
        argvs = [
            [GRADHUB, "run", "-n", "2", "--nnodes", "2", "--node-rank", str(i),
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{h0}:29400", "--rdzv-id", "mh",
             "--servers", "1", *server_opts, "--ps-secret-file", str(secret), *job]
            for i in range(2)
        ]  # fmt: skip
        _nodes(c, argvs, tmp_path, "2x2")
    reference = [GRADHUB, "run", "-n", "4", "--servers", "1", *server_opts, JOB, "--out",
                 str(one), "--strategies", "allreduce,sharded,ps-sync"]  # fmt: skip
    done = subprocess.run(reference, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    def load(d: Path, name: str, rank: int) -> list[torch.Tensor]:
        params: list[torch.Tensor] = torch.load(d / f"{name}.rank{rank}.pt")
        return params

    for name in ("allreduce", "sharded", "ps-sync", "allreduce-flat", "sharded-flat"):
        want = load(one, name.removesuffix("-flat"), 0)
        for rank in range(4):
            got = load(two, name, rank)
            # Every rank of the job holds the same bits.
            assert all(torch.equal(a, b) for a, b in zip(got, load(two, name, 0), strict=True))
            for a, b in zip(got, want, strict=True):
                if name.endswith("-flat"):
                    # The flat ring across hosts: the same fixed summation order
                    # as shared memory on one host, so the hosts do not change a bit.
                    assert torch.equal(a, b), f"{name} rank {rank} differs from 1 host x 4"
                else:
                    # ps-sync sums the workers' pushes in arrival order, which
                    # differs run to run even on one host; allreduce and sharded
                    # take the hierarchical path, which adds each host's two
                    # gradients first, (g0 + g1) + (g2 + g3), where one host adds
                    # ((ga + gb) + gc) + gd: fp32 reassociation, a few ulps of
                    # values ~1 after 3 momentum steps.
                    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # Bytes each host sent during one all-reduce of N = 8 MB: the hierarchical
    # path sends 2 (H - 1) / H * N = N per host (the least any all-reduce between
    # 2 hosts can send), the flat ring 2 (P - 1) / P * N = 1.5 N over the one
    # link per host that crosses hosts (ranks are consecutive on each host);
    # plus headers, acknowledgements and the store's messages (a few %).
    for rank in (0, 2):
        sent = json.loads((two / f"bytes.rank{rank}.json").read_text())
        n = sent["vector_bytes"]
        (auto, hierarchical), (ring, flat) = sent["auto"], sent["ring"]
        assert (auto, ring) == ("hierarchical", "ring"), sent
        assert n <= hierarchical <= 1.15 * n, sent
        assert 1.4 * n <= flat <= 1.7 * n, sent
        assert hierarchical <= 0.75 * flat, sent
    initial = [p.detach() for p in __import__("train_helpers").tiny_model(seed=0).parameters()]
    for rank in range(4):
        params = load(two, "ps-async", rank)
        assert all(torch.isfinite(p).all() for p in params)
        assert any(not torch.equal(p, q) for p, q in zip(params, initial, strict=True))
    # Without the secret the server refuses the hello: AuthenticationError, in
    # about one round trip. The client would wait REFUSAL_WAIT (30 s) for a
    # server that never answered (ServerUnavailableError); 10 s leaves a
    # loaded 2-core machine room and still cannot be mistaken for that.
    report = json.loads((two / "refused.json").read_text())
    without, with_secret = report["without"], report["with"]
    assert without["error"] == "AuthenticationError", report
    assert "refused this client's hello" in without["message"], report
    assert without["seconds"] < 10.0, report
    assert with_secret["error"] is None, report


def _readme_multinode_commands() -> list[str]:
    """The commands of the README's multi-node block, one per node."""
    text = (REPO / "README.md").read_text()
    block = re.search(r"<!-- multi-node: .*?```\n(.*?)```", text, re.S)
    assert block is not None, "README lost its multi-node block"
    return [line for line in block.group(1).splitlines() if line.startswith("gradhub run")]


@pytest.mark.slow
def test_readme_multinode_commands_train_digits_on_two_hosts(tmp_path: Path) -> None:
    commands = _readme_multinode_commands()
    assert len(commands) == 2
    with Cluster(2, rate="1gbit", gloo_ifname=False) as c:
        argvs = []
        for line in commands:
            argv = shlex.split(line.replace("10.0.0.1", c.hosts[0].addr))
            argv[0] = GRADHUB
            argvs.append([str(REPO / a) if a.startswith("examples/") else a for a in argv])
        _nodes(c, argvs, tmp_path, "digits")
    summaries = [
        json.loads(line)
        for f in sorted((tmp_path / "runs").glob("train_digits*/metrics.rank*.jsonl"))
        for line in f.read_text().splitlines()
        if '"summary"' in line
    ]
    assert len(summaries) == 4
    for s in summaries:
        assert s["world_size"] == 4
        assert s["eval_accuracy"] >= 0.95, s
