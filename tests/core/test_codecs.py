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
