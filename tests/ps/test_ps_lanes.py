"""Property tests of PriorityLanes, the queue of the local store, the server and the client."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gradhub.ps.lanes import PriorityLanes

# An operation is ("push", lane, priority) or ("pop",) or ("drop", lane).
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 3), st.integers(-2, 2)),
        st.tuples(st.just("pop")),
        st.tuples(st.just("drop"), st.integers(0, 3)),
    ),
    max_size=80,
)


def _reference_next(model: dict[int, list[tuple[int, int]]]) -> int | None:
    """The lane the contract says is served next: highest priority held in the
    lane; among equals, the lane whose item of that priority came first."""
    best: tuple[int, int] | None = None
    best_lane = None
    for lane, items in model.items():
        if not items:
            continue
        top = max(p for _, p in items)
        first = min(n for n, p in items if p == top)
        rank = (-top, first)
        if best is None or rank < best:
            best, best_lane = rank, lane
    return best_lane


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_matches_the_contract_step_by_step(ops: list[tuple[object, ...]]) -> None:
    lanes: PriorityLanes[int, int] = PriorityLanes()
    model: dict[int, list[tuple[int, int]]] = {}  # lane -> [(item number, priority)]
    counter = 0
    for op in ops:
        if op[0] == "push":
            lane, prio = int(op[1]), int(op[2])  # type: ignore[call-overload]
            lanes.push(lane, counter, prio)
            model.setdefault(lane, []).append((counter, prio))
            counter += 1
        elif op[0] == "drop":  # remove every item of one lane with an even number
            lane = int(op[1])  # type: ignore[call-overload]
            mine = {n for n, _ in model.get(lane, [])}
            removed = lanes.remove_if(lambda n, mine=mine: n in mine and n % 2 == 0)  # type: ignore[misc]
            assert sorted(removed) == sorted(n for n in mine if n % 2 == 0)
            model[lane] = [(n, p) for n, p in model.get(lane, []) if n % 2]
        else:
            expected_lane = _reference_next(model)
            peeked = lanes.peek()
            got = lanes.pop()
            assert peeked == got
            if expected_lane is None:
                assert got is None
                continue
            assert got is not None
            lane, item = got
            assert lane == expected_lane
            assert item == model[lane][0][0]  # the lane's first: never reordered
            model[lane].pop(0)
        assert len(lanes) == sum(len(v) for v in model.values())
        assert bool(lanes) == (len(lanes) > 0)
    # Drain: every lane's items leave in the order they came.
    rest = [item for _, item in iter(lanes.pop, None)]
    assert sorted(rest) == sorted(n for v in model.values() for n, _ in v)
    assert len(lanes) == 0 and lanes.pop() is None


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 0)), max_size=60))
def test_one_priority_is_first_in_first_out(pushes: list[tuple[int, int]]) -> None:
    lanes: PriorityLanes[int, int] = PriorityLanes()
    for i, (lane, prio) in enumerate(pushes):
        lanes.push(lane, i, prio)
    assert [item for _, item in iter(lanes.pop, None)] == list(range(len(pushes)))


def test_an_urgent_item_lifts_the_earlier_items_of_its_lane() -> None:
    lanes: PriorityLanes[str, str] = PriorityLanes()
    lanes.push("x", "x-push", 50)
    lanes.push("w", "w-push", -10)
    lanes.push("w", "w-pull", 100)
    assert [item for _, item in iter(lanes.pop, None)] == ["w-push", "w-pull", "x-push"]
