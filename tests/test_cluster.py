"""The emulated cluster of tests/cluster.py: set-up checks and teardown. Skipped without root."""

from __future__ import annotations

import os

import pytest

from cluster import Cluster, ClusterError, _offloads_off

_why = Cluster.unavailable()
pytestmark = pytest.mark.skipif(_why is not None, reason=f"emulated cluster: {_why}")


def test_offloads_that_cannot_be_turned_off_fail_the_set_up() -> None:
    missing = f"ghnone{os.getpid()}"
    with pytest.raises(ClusterError, match=f"cannot turn tso off on {missing}"):
        _offloads_off(missing)
