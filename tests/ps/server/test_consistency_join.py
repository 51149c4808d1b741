"""A replacement in a surviving job's membership (:meth:`Consistency.set_members`):
a worker id new to the job counts from the steps each key has applied, so the
next step's round waits for its push (sync) and ssp's staleness bound does
not wait for its past. The whole job is in ``tests/jobs/test_survive_ps_join.py``."""

from __future__ import annotations

import torch

from gradhub.ps.server.consistency import Consistency


def _push(rounds: Consistency, worker: int, step: int, gen: int) -> list[float] | None:
    out = rounds.push(worker, "w", torch.tensor([1.0]), step=step, generation=gen)
    return None if out is None else [float(t[0]) for t in out]


def _members(mode: str) -> Consistency:
    """Workers 0, 1, 2 applied steps 0-2 of key ``w``; then 2 died (generation 1)."""
    rounds = Consistency(mode, workers=3, max_staleness=1)
    for w in range(3):
        rounds.seen(w, pushing=True)
    for step in range(3):
        for w in range(3):
            _push(rounds, w, step, gen=0)
    assert rounds.set_members([0, 1], generation=1)
    return rounds


def test_sync_a_replacement_joins_the_next_steps_round() -> None:
    rounds = _members("sync")
    assert rounds.set_members([0, 1, 3], generation=2)  # worker 3 replaces 2
    assert rounds.steps["w"][3] == 3 == rounds.rounds_applied["w"]
    assert _push(rounds, 0, 3, gen=2) == [] and _push(rounds, 1, 3, gen=2) == []
    assert not rounds.pull_ready(0, "w")  # the round waits for the replacement
    assert _push(rounds, 3, 3, gen=2) == [3.0]
    assert rounds.pull_ready(0, "w") and rounds.pull_ready(3, "w")
    assert rounds.summary()["steps"]["w"] == {"0": 4, "1": 4, "2": 3, "3": 4}


def test_ssp_a_replacement_is_not_counted_at_step_0() -> None:
    rounds = _members("ssp")
    assert rounds.set_members([0, 1, 3], generation=2)
    assert rounds.pull_ready(3, "w")
    for w in (0, 1, 3):  # step 3: each push applied once the last member's arrived
        _push(rounds, w, 3, gen=2)
    assert rounds.rounds_applied["w"] == 4
    # The survivors, one step ahead of nobody: their pulls are answered (with the
    # replacement counted at step 0 they would wait, 4 steps ahead of it).
    assert rounds.pull_ready(0, "w") and rounds.pull_ready(1, "w")
    assert rounds.steps["w"][3] == 4
