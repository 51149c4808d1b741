"""The emulated cluster of tests/cluster.py: set-up checks and teardown. Skipped without root."""

from __future__ import annotations

import os
import subprocess

import pytest

from cluster import Cluster, ClusterError, _offloads_off, offloads

_why = Cluster.unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"emulated cluster: {_why}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def _listed(*ip_args: str) -> str:
    return subprocess.run(["ip", *ip_args], capture_output=True, text=True, timeout=30).stdout


def test_a_failing_body_leaves_no_namespace_link_or_process_behind() -> None:
    with pytest.raises(RuntimeError, match="the body failed"), Cluster(2, rate="1gbit") as c:
        tag = c.tag
        assert len([n for n in _listed("netns", "list").split() if tag in n]) == 2
        for host in c.hosts:
            # Read back from the kernel: the limiters see wire-sized packets.
            assert offloads(c._veth(host)) == {"tso": False, "gso": False, "gro": False}
        direct = c.popen(0, ["sleep", "600"])
        # One that left popen's session, as torchrun's workers do: only the
        # namespace still finds it.
        escaped = c.run(1, ["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 & echo $!"])
        pids = [direct.pid, int(escaped.stdout)]
        assert all(_alive(p) for p in pids)
        raise RuntimeError("the body failed")
    assert tag not in _listed("netns", "list")
    assert tag not in _listed("-o", "link", "show")  # the bridge and both ends of each veth
    assert [p for p in pids if _alive(p)] == []


def test_offloads_that_cannot_be_turned_off_fail_the_set_up() -> None:
    missing = f"ghnone{os.getpid()}"
    with pytest.raises(ClusterError, match=f"cannot turn tso off on {missing}"):
        _offloads_off(missing)
