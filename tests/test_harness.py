import os

import pytest

from harness import RanksFailed, run_ranks


def _echo(rank: int, world_size: int, extra: int) -> tuple[int, int, str, int]:
    return rank, world_size, os.environ["MASTER_ADDR"], extra


def _fail_on_one(rank: int, world_size: int) -> int:
    if rank == 1:
        raise RuntimeError("rank one fails on purpose")
    return rank


def _hang(rank: int, world_size: int) -> None:
    import threading

    if rank == 0:
        threading.Event().wait()  # never set: only the harness ends this rank


@pytest.mark.slow
def test_every_rank_runs_with_the_launcher_environment() -> None:
    results = run_ranks(_echo, 3, 7, timeout=60)
    assert [r.value for r in results] == [(r, 3, "127.0.0.1", 7) for r in range(3)]


@pytest.mark.slow
def test_a_failing_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(RanksFailed, match="rank one fails on purpose"):
        run_ranks(_fail_on_one, 2, timeout=60)


@pytest.mark.slow
def test_a_hanging_rank_is_killed_at_the_timeout() -> None:
    # 12 s: long enough for rank 1 (which imports neither torch nor gradhub)
    # to start, return and exit on a loaded machine.
    results = run_ranks(_hang, 2, timeout=12, check=False)
    assert results[1].ok
    assert not results[0].ok and results[0].killed
