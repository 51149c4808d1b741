"""What the parameter servers do for a surviving job (``gradhub run --survive``):
sync rounds of a step (pushes tagged with the job's step and membership
generation), a new membership (:meth:`Consistency.set_members`, the client's
``set_members``), and ssp's staleness bound without the dead worker.

The whole jobs are in ``tests/jobs/test_survive_ps.py``.
"""

from __future__ import annotations

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
