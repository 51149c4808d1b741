"""The ring schedule, checked by simulating the ring in one process (no sockets)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradhub.partition import partition_ranges
from gradhub.transports import schedule


def simulate_reduce_scatter(values: list[list[str]], world_size: int) -> list[list[str]]:
    """Run the reduce-scatter schedule on symbolic values: each element is a
    string naming the ranks added so far, in order. Returns what each rank
    holds of its own chunk."""
    size = len(values[0])
    ranges = partition_ranges(size, world_size)
    # outbox[r] = (chunk, partial sums) rank r sent at the last step
    outbox = {}
    for r in range(world_size):
        c = schedule.reduce_scatter_send_chunk(r, 0, world_size)
        s, n = ranges[c]
        outbox[r] = (c, [values[r][i] for i in range(s, s + n)])
    result: list[list[str]] = [[] for _ in range(world_size)]
    for step in range(world_size - 1):
        new_outbox = {}
        for r in range(world_size):
            c = schedule.reduce_scatter_recv_chunk(r, step, world_size)
            sent_chunk, partial = outbox[(r - 1) % world_size]
            assert sent_chunk == c, "a rank received a chunk other than the one it expected"
            s, _ = ranges[c]
            summed = [p + "+" + values[r][s + i] for i, p in enumerate(partial)]
            if step == world_size - 2:
                assert c == r, "after the last step a rank must hold its own chunk"
                result[r] = summed
            else:
                new_outbox[r] = (c, summed)
        outbox = new_outbox
    return result


@given(st.integers(2, 9), st.integers(0, 40))
def test_reduce_scatter_schedule_sums_every_rank_once_in_the_documented_order(
    world_size: int, size: int
) -> None:
    values = [[f"{r}" for _ in range(size)] for r in range(world_size)]
    result = simulate_reduce_scatter(values, world_size)
    ranges = partition_ranges(size, world_size)
    for r in range(world_size):
        order = "+".join(map(str, schedule.reduction_order(r, world_size)))
        assert result[r] == [order] * ranges[r][1]
        assert sorted(schedule.reduction_order(r, world_size)) == list(range(world_size))
        assert schedule.reduction_order(r, world_size)[-1] == r


@given(st.integers(2, 9))
def test_all_gather_schedule_delivers_every_chunk_once(world_size: int) -> None:
    held = [{r} for r in range(world_size)]
    sent_last = dict(enumerate(range(world_size)))  # rank -> chunk it sends at step 0
    for step in range(world_size - 1):
        for r in range(world_size):
            assert schedule.all_gather_send_chunk(r, step, world_size) == sent_last[r]
        received = {}
        for r in range(world_size):
            c = schedule.all_gather_recv_chunk(r, step, world_size)
            assert c == sent_last[(r - 1) % world_size]
            assert c not in held[r], "a chunk arrived twice"
            received[r] = c
        for r, c in received.items():
            held[r].add(c)
        sent_last = received
    assert all(h == set(range(world_size)) for h in held)


@given(st.integers(0, 10_000), st.integers(0, 5000), st.integers(1, 3000))
def test_sub_ranges_cover_the_chunk_in_order(start: int, length: int, max_elements: int) -> None:
    pieces = schedule.sub_ranges(start, length, max_elements)
    assert sum(n for _, n in pieces) == length
    pos = start
    for s, n in pieces:
        assert s == pos and 1 <= n <= max_elements
        pos += n
    if length:
        assert len(pieces) == -(-length // max_elements)


@given(st.integers(0, 5000), st.integers(0, (1 << 20) - 1))
def test_message_tags_are_distinct_and_fit_in_int32(sequence: int, index: int) -> None:
    tag = schedule.message_tag(sequence, index)
    assert 0 <= tag < 2**31
    assert tag & ((1 << 20) - 1) == index
    assert schedule.message_tag(sequence + 1, index) != tag


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="max_elements"):
        schedule.sub_ranges(0, 10, 0)
    with pytest.raises(ValueError, match="too many messages"):
        schedule.message_tag(0, 1 << 20)
