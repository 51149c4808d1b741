"""What the parameter servers do for a surviving job (``gradhub run --survive``):
rounds of a step (pushes tagged with the job's step and membership
generation: sync sums a round, async and ssp apply each push of it once the
round is complete), a new membership (:meth:`Consistency.set_members`, the
client's ``set_members``), and ssp's staleness bound without the dead worker.

The whole jobs are in ``tests/jobs/test_survive_ps.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gradhub import RemoteParameterServer, ServerConfig, start_server
from gradhub.ps.server.consistency import Consistency


def _sync(workers: int = 3) -> Consistency:
    rounds = Consistency("sync", workers=workers)
    for w in range(workers):
        rounds.seen(w, pushing=True)
    return rounds


def _push(rounds: Consistency, worker: int, value: float, step: int, gen: int = 0) -> list[float]:
    """The sums applied by a tagged push of ``value`` to key ``w`` (``[-1.0]``: ignored)."""
    out = rounds.push(worker, "w", torch.tensor([value]), step=step, generation=gen)
    return [-1.0] if out is None else [float(t[0]) for t in out]


def test_a_step_is_applied_once_every_member_pushed_for_it_and_only_once() -> None:
    rounds = _sync()
    assert _push(rounds, 0, 1.0, step=0) == []
    assert _push(rounds, 1, 2.0, step=0) == []
    assert not rounds.pull_ready(0, "w") and rounds.pull_ready(2, "w")
    assert _push(rounds, 2, 4.0, step=0) == [7.0]
    assert rounds.pull_ready(0, "w")
    # A redo of step 0 (a survivor saw the death before its pull came back): ignored.
    assert _push(rounds, 0, 1.0, step=0) == [-1.0]
    assert rounds.pull_ready(0, "w") and rounds.applied_step["w"] == 0
    assert rounds.summary()["rounds_applied"] == {"w": 1}


def test_a_new_membership_drops_the_round_the_dead_worker_never_completed() -> None:
    rounds = _sync()
    _push(rounds, 0, 1.0, step=0)
    _push(rounds, 2, 4.0, step=0)  # worker 2 pushed, then died; worker 1 never pushed
    assert rounds.set_members([0, 1], generation=1)
    assert not rounds.set_members([0, 1], generation=1)  # the same membership again
    assert rounds.pull_ready(0, "w") and rounds.pending["w"] == {}
    # The redo over the survivors: the dead worker's push is not in its sum.
    assert _push(rounds, 0, 16.0, step=0, gen=1) == []
    assert _push(rounds, 1, 32.0, step=0, gen=1) == [48.0]
    # A push made before the membership, still on its way, and the dead worker's: ignored.
    assert _push(rounds, 1, 2.0, step=1, gen=0) == [-1.0]
    assert _push(rounds, 2, 4.0, step=1, gen=1) == [-1.0]
    assert not rounds.seen(2) and 2 not in rounds.live  # it never rejoins
    summary = rounds.summary()
    assert (summary["generation"], summary["left"], summary["live"]) == (1, [2], [0, 1])


def test_only_a_membership_takes_a_silent_member_out_of_a_step() -> None:
    rounds = _sync()
    _push(rounds, 0, 1.0, step=0)
    _push(rounds, 1, 2.0, step=0)
    assert rounds.expire(timeout=1.0, now=1e12) == [0, 1, 2]  # every one silent
    assert rounds.complete_rounds("w") == []  # the heartbeat does not complete it
    assert "sync step 0 of 'w' waits for worker(s) 2" in rounds.waiting_for(0, "w")


def test_the_membership_survives_a_checkpoint() -> None:
    rounds = _sync()
    _push(rounds, 0, 1.0, step=0)
    rounds.set_members([0, 1], generation=3)
    _push(rounds, 0, 1.0, step=0, gen=3)
    _push(rounds, 1, 1.0, step=0, gen=3)
    restored = Consistency("sync", workers=3)
    restored.load_state_dict(rounds.state_dict())
    assert (restored.generation, restored.left, restored.live) == (3, {2}, {0, 1})
    assert restored.workers == 2 and restored.applied_step == {"w": 0}
    assert restored.push(1, "w", torch.ones(1), step=0, generation=3) is None


def test_ssp_stops_waiting_for_a_dead_worker_once_told() -> None:
    bound = Consistency("ssp", workers=3, max_staleness=1)
    for w in range(3):
        bound.seen(w, pushing=True)
    for _ in range(3):
        bound.push(0, "w", torch.ones(1))
    bound.push(1, "w", torch.ones(1))
    bound.push(1, "w", torch.ones(1))
    assert not bound.pull_ready(0, "w")  # worker 2 is at step 0, three behind
    bound.set_members([0, 1], generation=1)
    assert bound.pull_ready(0, "w")  # worker 1 is one behind: within the bound
    assert bound.push(2, "w", torch.ones(1)) is not None and 2 not in bound.live


def test_a_sync_server_restarts_a_step_for_the_survivors() -> None:
    """Through a server and its clients: worker 2 pushed step 0 and died, worker 1
    did not push; worker 0's pull waits. The membership [0, 1] answers it with
    the value before the step; the redo is applied, and worker 2's push of the
    old generation, arriving late, is counted as superseded."""
    config = ServerConfig(lr=1.0, mode="sync", workers=3, heartbeat_timeout=60)
    with (
        start_server(config, in_thread=True) as server,
        RemoteParameterServer(server.address, worker_id=0, timeout=20.0) as a,
        RemoteParameterServer(server.address, worker_id=1, timeout=20.0) as b,
        RemoteParameterServer(server.address, worker_id=2, timeout=20.0) as dead,
    ):
        a.init("w", torch.zeros(2))
        dead.push("w", torch.full((2,), 100.0), step=(0, 0)).result(10)
        a.push("w", torch.ones(2), step=(0, 0)).result(10)
        value = torch.full((2,), -1.0)
        waiting = a.pull("w", value)
        assert not waiting.done()
        a.set_members([0, 1], 1)
        waiting.result(10)
        assert value.tolist() == [0.0, 0.0]  # the dropped round was never applied
        a.push("w", torch.ones(2), step=(0, 1)).result(10)
        b.push("w", torch.full((2,), 2.0), step=(0, 1)).result(10)
        dead.push("w", torch.full((2,), 100.0), step=(1, 0)).result(10)
        a.pull("w", value).result(10)
        assert value.tolist() == [-3.0, -3.0]  # lr 1: minus the redo's sum
        counters = a.stats()[0]["counters"]
        assert (counters["updates"], counters["push_superseded"]) == (1, 1)


def _members(mode: str, workers: int = 3) -> Consistency:
    held = Consistency(mode, workers=workers, max_staleness=1)
    for w in range(workers):
        held.seen(w, pushing=True)
    return held


def _each(held: Consistency, worker: int, key: str, value: float, step: int, gen: int = 0) -> Any:
    """The updates a tagged push of ``value`` to ``key`` makes (None: ignored)."""
    out = held.push(worker, key, torch.tensor([value]), step=step, generation=gen)
    return None if out is None else [float(t[0]) for t in out]


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_key_applies_each_share_of_a_step_once_when_a_worker_dies_between_two_keys(
    mode: str,
) -> None:
    """Worker 2 pushes key ``a`` of step 0 and dies before ``b``; workers 0 and 1
    pushed both. Key ``a`` applies the three shares (each on its own, in worker
    order) once the last arrives; ``b`` holds two and is dropped by the new
    membership. The redo over the survivors is ignored on ``a`` and applied
    on ``b``: each key gets the global batch once, never a share twice."""
    held = _members(mode)
    assert _each(held, 2, "a", 4.0, step=0) == []
    assert _each(held, 1, "a", 2.0, step=0) == []
    assert _each(held, 1, "b", 20.0, step=0) == []
    assert _each(held, 0, "b", 10.0, step=0) == []  # waits for worker 2's push of b
    assert _each(held, 0, "a", 1.0, step=0) == [1.0, 2.0, 4.0]
    assert _each(held, 0, "a", 1.0, step=0) is None  # one push per worker and step
    assert held.set_members([0, 1], generation=1)
    assert held.pending == {"a": {}, "b": {}}
    assert held.summary()["steps"] == {"a": {"0": 1, "1": 1, "2": 1}, "b": {"0": 0, "1": 0}}
    # The redo, split over the survivors (worker 0: 3 of the samples, worker 1: the rest).
    assert _each(held, 0, "a", 3.0, step=0, gen=1) is None  # a's step is applied
    assert _each(held, 0, "b", 30.0, step=0, gen=1) == []
    assert _each(held, 1, "b", 40.0, step=0, gen=1) == [30.0, 40.0]
    assert _each(held, 1, "a", 4.0, step=0, gen=1) is None
    # A push of the old generation still on its way, and the dead worker's: ignored.
    assert _each(held, 1, "a", 5.0, step=1, gen=0) is None
    assert _each(held, 2, "b", 5.0, step=1, gen=1) is None
    assert held.rounds_applied == {"a": 1, "b": 1}
    assert held.pull_ready(0, "a") and held.pull_ready(1, "b")
    # The next step goes on over the survivors alone.
    assert _each(held, 1, "a", 6.0, step=1, gen=1) == []
    assert _each(held, 0, "a", 5.0, step=1, gen=1) == [5.0, 6.0]
    assert held.summary()["steps"]["a"] == {"0": 2, "1": 2, "2": 1}


def test_a_skip_push_completes_a_held_step_and_applies_nothing() -> None:
    """A worker that did not use a parameter (or skipped the step) sends a skip
    push: the step of the key is complete without its share."""
    held = _members("async", workers=2)
    assert held.push(0, "w", torch.ones(1), skip=True, step=0, generation=0) == []
    assert _each(held, 1, "w", 2.0, step=0) == [2.0]
    assert held.pending["w"] == {} and held.rounds_applied == {"w": 1}


def test_ssp_counts_no_dropped_push_in_a_survivors_staleness() -> None:
    """A survivor whose push of the failed step was held (and dropped) is not a
    step ahead of one whose push arrived after the new membership (ignored)."""
    held = _members("ssp")
    held.max_staleness = 0
    _each(held, 0, "w", 1.0, step=0)
    _each(held, 2, "w", 1.0, step=0)  # worker 2 dies; worker 1's push comes too late
    held.set_members([0, 1], generation=1)
    assert _each(held, 1, "w", 1.0, step=0, gen=0) is None
    assert held.pull_ready(0, "w") and held.pull_ready(1, "w")
    assert _each(held, 0, "w", 1.0, step=0, gen=1) == []
    assert not held.pull_ready(0, "w")  # one ahead of worker 1, with max_staleness 0
    assert _each(held, 1, "w", 2.0, step=0, gen=1) == [1.0, 2.0]
    assert held.pull_ready(0, "w") and held.pull_ready(1, "w")


def test_held_pushes_survive_a_checkpoint() -> None:
    held = _members("async")
    _each(held, 2, "w", 4.0, step=0)
    _each(held, 0, "w", 1.0, step=0)
    restored = Consistency("async", workers=3)
    restored.load_state_dict(held.state_dict())
    assert _each(restored, 1, "w", 2.0, step=0) == [1.0, 2.0, 4.0]


def test_an_async_server_applies_a_step_of_the_dead_workers_key_once() -> None:
    """Through a server and its clients: worker 2 pushed key ``a`` of step 0 and
    died; the survivors pushed ``a`` and ``b``. ``a`` takes the three shares,
    ``b`` none until the membership [0, 1]; the redo is applied on ``b`` only."""
    config = ServerConfig(lr=1.0, mode="async", workers=3, heartbeat_timeout=60)
    with (
        start_server(config, in_thread=True) as server,
        RemoteParameterServer(server.address, worker_id=0, timeout=20.0) as a,
        RemoteParameterServer(server.address, worker_id=1, timeout=20.0) as b,
        RemoteParameterServer(server.address, worker_id=2, timeout=20.0) as dead,
    ):
        for key in ("a", "b"):
            a.init(key, torch.zeros(2))
        dead.push("a", torch.full((2,), 4.0), step=(0, 0)).result(10)
        for client, share in ((a, 1.0), (b, 2.0)):
            for key in ("a", "b"):
                client.push(key, torch.full((2,), share), step=(0, 0)).result(10)
        value = torch.zeros(2)
        a.pull("b", value).result(10)
        assert value.tolist() == [0.0, 0.0]  # held for worker 2's share
        a.set_members([0, 1], 1)
        for client, share in ((a, 8.0), (b, 16.0)):
            for key in ("a", "b"):
                client.push(key, torch.full((2,), share), step=(0, 1)).result(10)
        a.pull("a", value).result(10)
        assert value.tolist() == [-7.0, -7.0]  # lr 1: minus the three first shares
        a.pull("b", value).result(10)
        assert value.tolist() == [-24.0, -24.0]  # minus the redo's two
        counters = a.stats()[0]["counters"]
        assert (counters["updates"], counters["push_superseded"]) == (5, 2)
