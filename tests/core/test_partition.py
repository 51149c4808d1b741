import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradhub.partition import partition_range, partition_ranges, segment_ranges

sizes = st.integers(min_value=0, max_value=10_000)
parts = st.integers(min_value=1, max_value=64)


@given(sizes, parts)
def test_slices_are_disjoint_and_cover_in_order(size: int, p: int) -> None:
    ranges = partition_ranges(size, p)
    assert len(ranges) == p
    position = 0
    for start, length in ranges:
        assert start == position  # contiguous: no gap, no overlap
        assert length >= 0
        position += length
    assert position == size


@given(sizes, parts)
def test_lengths_differ_by_at_most_one_longer_first(size: int, p: int) -> None:
    lengths = [partition_range(size, p, i)[1] for i in range(p)]
    assert max(lengths) - min(lengths) <= 1
    longer = size % p
    assert all(n == size // p + 1 for n in lengths[:longer])
    assert all(n == size // p for n in lengths[longer:])


@given(
    st.integers(min_value=1, max_value=63).flatmap(
        lambda p: st.tuples(st.integers(0, p - 1), st.just(p))
    )
)
def test_size_smaller_than_partitions(case: tuple[int, int]) -> None:
    size, p = case
    ranges = partition_ranges(size, p)
    assert [n for _, n in ranges] == [1] * size + [0] * (p - size)
    assert all(start == min(i, size) for i, (start, _) in enumerate(ranges))


def test_bigdl_formula_example() -> None:
    # q, r = divmod(10, 4) = 2, 2: partitions of 3, 3, 2, 2.
    assert partition_ranges(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]


@pytest.mark.parametrize(("size", "p", "pid"), [(-1, 2, 0), (4, 0, 0), (4, 2, 2), (4, 2, -1)])
def test_bad_arguments(size: int, p: int, pid: int) -> None:
    with pytest.raises(ValueError):
        partition_range(size, p, pid)


@given(st.data(), sizes, parts)
def test_segment_ranges_are_each_partition_s_part_of_the_segment(
    data: st.DataObject, size: int, p: int
) -> None:
    offset = data.draw(st.integers(0, size))
    length = data.draw(st.integers(0, size - offset))
    ranges = segment_ranges(size, p, offset, length)
    position = 0
    for (start, n), (slice_start, slice_length) in zip(
        ranges, partition_ranges(size, p), strict=True
    ):
        assert start == position  # back to back, covering the segment
        # exactly the elements of the segment inside this partition's slice
        inside = range(max(offset, slice_start), min(offset + length, slice_start + slice_length))
        assert n == len(inside)
        if n:
            assert offset + start == inside[0]
        position += n
    assert position == length


def test_segment_outside_the_vector_is_refused() -> None:
    with pytest.raises(ValueError, match="not inside"):
        segment_ranges(10, 2, 8, 3)
