import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from gradhub import codecs

COMPRESSED = ["fp16", "bf16", "bf16-truncate"]


def test_get_knows_every_codec_and_refuses_others() -> None:
    assert set(codecs.available()) == {"none", *COMPRESSED}
    assert codecs.get("BF16").name == "bf16"
    with pytest.raises(ValueError, match="unknown compress='zip'"):
        codecs.get("zip")


def test_bf16_truncate_keeps_the_high_bits() -> None:
    c = codecs.get("bf16-truncate")
    x = torch.tensor([1.111111, 4.111111, -1.111111])
    assert c.decode(c.encode(x)).tolist() == [1.109375, 4.09375, -1.109375]
    integers = torch.arange(-256, 257, dtype=torch.float32)
    assert torch.equal(c.decode(c.encode(integers)), integers)


def test_bf16_rounds_to_nearest_where_truncate_does_not() -> None:
    x = torch.tensor([1.111111])
    assert codecs.get("bf16").decode(codecs.get("bf16").encode(x)).item() == 1.109375
    y = torch.tensor([1.0 + 3 * 2**-9])  # 3/4 of a quantum: nearest rounds up, truncation down
    assert codecs.get("bf16").decode(codecs.get("bf16").encode(y)).item() == 1.0 + 2**-7
    t = codecs.get("bf16-truncate")
    assert t.decode(t.encode(y)).item() == 1.0


@pytest.mark.parametrize("name", COMPRESSED)
def test_two_bytes_per_element_on_the_wire(name: str) -> None:
    c = codecs.get(name)
    wire = c.encode(torch.randn(1000))
    assert c.bytes_per_element == 2
    assert wire.element_size() * wire.numel() == 2000
    assert codecs.get("none").bytes_per_element == 4


normal_values = arrays(
    np.float32,
    st.integers(1, 64),
    elements=st.floats(2**-10, 2**15, width=32) | st.floats(-(2**15), -(2**-10), width=32),
)


@settings(max_examples=50, deadline=None)
@given(normal_values)
@pytest.mark.parametrize("name", ["none", *COMPRESSED])
def test_round_trip_error_bound(name: str, values: np.ndarray) -> None:
    c = codecs.get(name)
    x = torch.from_numpy(values)
    before = x.clone()
    y = c.decode(c.encode(x))
    assert torch.equal(x, before)  # encode leaves its input alone
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert torch.all((y - x).abs() <= c.relative_error * x.abs())


def test_fp16_saturates_instead_of_overflowing() -> None:
    c = codecs.get("fp16")
    assert c.decode(c.encode(torch.tensor([1e6, -1e6]))).tolist() == [65504.0, -65504.0]


@pytest.mark.parametrize("name", COMPRESSED)
def test_error_feedback_keeps_running_sum_within_one_quantum(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    feedback = codecs.ErrorFeedback(name)
    plain = codecs.get(name)
    true_sum = torch.zeros(256, dtype=torch.float64)
    fed_sum = torch.zeros(256, dtype=torch.float64)
    plain_sum = torch.zeros(256, dtype=torch.float64)
    for _ in range(200):
        x = torch.rand(256, generator=gen) * 0.01 + 1.0  # values in [1, 1.01)
        true_sum += x.double()
        fed_sum += feedback.decode(feedback.encode(x)).double()
        plain_sum += plain.decode(plain.encode(x)).double()
    # One quantum at magnitude ~1 is 2**-10 (fp16), 2**-7 (bf16) or 2**-7
    # (truncation); the residual is bounded by it (times |x| ~ 1.01).
    quantum = {"fp16": 2**-10, "bf16": 2**-7, "bf16-truncate": 2**-7}[name]
    assert (fed_sum - true_sum).abs().max().item() <= quantum * 1.01
    # Without feedback the error grows with the number of steps (truncation
    # always loses, so its drift is large); feedback must do far better.
    assert (fed_sum - true_sum).abs().max() < (plain_sum - true_sum).abs().max()


def test_error_feedback_refuses_a_different_shape() -> None:
    fb = codecs.ErrorFeedback("bf16")
    fb.encode(torch.ones(3))
    with pytest.raises(ValueError, match="one ErrorFeedback per buffer"):
        fb.encode(torch.ones(4))


# fp4: E2M1 in blocks of 32 with an fp32 scale each (a tensor codec) ------------------

FP4 = codecs.FP4()
TINY = 6 * 2.0**-126  # below this largest magnitude a block's scale is subnormal

fp4_values = arrays(
    np.float32,
    st.integers(0, 100),
    elements=st.floats(-(2.0**100), 2.0**100, width=32)
    | st.sampled_from([0.0, -0.0, 2.0**-120, -(2.0**-149)]),
)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """Each value's block's largest magnitude."""
    padded = torch.zeros(-(-x.numel() // 32) * 32)
    padded[: x.numel()] = x.reshape(-1).abs()
    return padded.view(-1, 32).amax(dim=1).repeat_interleave(32)[: x.numel()]


@settings(max_examples=100, deadline=None)
@given(fp4_values, st.sampled_from([(-1,), (-1, 1), (1, -1, 1)]))
def test_fp4_round_trip_within_its_stated_bound(values: np.ndarray, shape: tuple[int]) -> None:
    """``|y - x| <= max(relative_error |x|, m / 24)`` (m: the block's largest
    magnitude) where the scale is normal; within 2 m below; the shape comes back."""
    x = torch.from_numpy(values).reshape(shape)
    before = x.clone()
    wire = FP4.encode(x)
    y = FP4.decode(wire)
    assert torch.equal(x, before)
    assert y.dtype == torch.float32 and y.shape == x.shape
    assert wire.dtype == torch.uint8 and wire.numel() == FP4.wire_bytes(x.shape)
    m = _blocks(x)
    err = (y - x).reshape(-1).abs().double()
    bound = torch.maximum(FP4.relative_error * x.reshape(-1).abs(), m / 24).double()
    # 1e-6 relative: the scale m / 6 and x / scale are rounded in fp32.
    normal = m >= TINY
    assert torch.all(err[normal] <= bound[normal] * (1 + 1e-6))
    assert torch.all(err[~normal] <= 2 * m[~normal].double() + 2.0**-149)


def test_fp4_grid_ties_zeros_and_the_largest_value() -> None:
    """Exact E2M1 values travel exactly, ties go to the even code, zeros stay
    zeros (``-0.0`` as ``0.0``), the block's largest value comes back."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -6.0, -0.5, -0.0])
    assert torch.equal(FP4.decode(FP4.encode(grid)), grid)
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    assert FP4.decode(FP4.encode(ties)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    zeros = torch.zeros(70)
    assert torch.equal(FP4.decode(FP4.encode(zeros)), zeros)
    largest = float(torch.finfo(torch.float32).max)
    assert FP4.decode(FP4.encode(torch.tensor([largest, -largest, 1.0]))).tolist()[:2] == [
        largest,
        -largest,
    ]
    assert FP4.decode(FP4.encode(torch.tensor(3.0))).shape == ()
    assert FP4.decode(FP4.encode(torch.zeros(0, 4))).shape == (0, 4)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_fp4_a_non_finite_value_makes_its_block_nan(bad: float) -> None:
    x = torch.ones(64)
    x[40] = bad
    y = FP4.decode(FP4.encode(x))
    assert torch.equal(y[:32], x[:32])  # the other block travels as ever
    assert torch.isnan(y[32:]).all()


def test_fp4_bytes_and_where_it_is_taken() -> None:
    """20 bytes per 32 values plus the shape; a tensor codec: diloco takes it,
    the entry points that cut the wire refuse it saying so."""
    assert FP4.wire_bytes((1000,)) == 16 + 32 * 20
    assert FP4.bytes_ratio == 20 / 128
    assert "fp4" in codecs.available(codecs.TENSOR)
    assert "fp4" not in codecs.available()  # the elementwise wire codecs
    assert codecs.check("FP4", for_="diloco") == "fp4"
    assert codecs.check(FP4, for_="diloco") == "fp4"
    for entry in ("a wire codec", "sharded", "AllReduceParameter", "RemoteParameterServer"):
        for name in ("fp4", FP4):
            with pytest.raises(ValueError, match=r"(?s)is a tensor codec.*goes with strategy"):
                codecs.check(name, for_=entry)
