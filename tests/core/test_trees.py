import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from gradhub import ShapeMismatchError, trees
from gradhub.trees import (
    TreeSpec,
    all_finite,
    as_tree,
    clone_tree,
    copy_finite,
    flatten,
    leaves,
    map_tree,
    tree_to_numpy,
)


def sample_tree() -> dict:
    return {
        "layer1": {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.tensor([6.0, 7.0])},
        "heads": [torch.tensor(8.0), (torch.tensor([9.0]), torch.tensor([[10.0]]))],
    }


def test_flatten_and_unflatten_round_trip() -> None:
    tree = sample_tree()
    spec = TreeSpec.of(tree)
    flat = spec.flatten(tree)
    assert flat.dtype == torch.float32 and flat.is_contiguous()
    assert flat.tolist() == [float(i) for i in range(11)]
    assert spec.numel == 11 and spec.num_leaves == 5
    rebuilt = spec.unflatten(flat)
    assert TreeSpec.of(rebuilt) == spec
    assert isinstance(rebuilt["heads"][1], tuple)
    for a, b in zip(leaves(rebuilt), leaves(tree), strict=True):
        assert torch.equal(a, b)


def test_unflatten_into_writes_in_place_and_keeps_dtypes() -> None:
    target = {"a": torch.zeros(2, dtype=torch.float64), "b": torch.zeros(1, dtype=torch.float16)}
    spec = TreeSpec.of(target)
    a = target["a"]
    spec.unflatten_into(torch.tensor([1.0, 2.0, 3.0]), target)
    assert target["a"] is a and a.tolist() == [1.0, 2.0]
    assert target["b"].dtype == torch.float16 and target["b"].item() == 3.0


def test_dict_key_order_does_not_matter() -> None:
    spec = TreeSpec.of({"x": torch.zeros(1), "y": torch.ones(2)})
    other = {"y": torch.tensor([5.0, 6.0]), "x": torch.tensor([4.0])}
    assert spec.flatten(other).tolist() == [4.0, 5.0, 6.0]


@pytest.mark.parametrize(
    ("tree", "path", "what"),
    [
        (
            {
                "layer1": {"weight": torch.zeros(3, 2), "bias": torch.zeros(2)},
                "heads": [torch.ones(()), (torch.ones(1), torch.ones(1, 1))],
            },
            "['layer1']['weight']",
            "shape",
        ),
        ({"layer1": {"weight": torch.zeros(2, 3)}}, "<root>", "structure"),
        (
            {
                "layer1": {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)},
                "heads": [torch.tensor(1.0)],
            },
            "['heads']",
            "structure",
        ),
        (
            {
                "layer1": {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)},
                "heads": [torch.tensor(1.0), [torch.ones(1), torch.ones(2, 1)]],
            },
            "['heads'][1][1]",
            "shape",
        ),
    ],
)
def test_mismatch_names_the_path(tree, path: str, what: str) -> None:
    spec = TreeSpec.of(sample_tree())
    with pytest.raises(ShapeMismatchError) as info:
        spec.check(tree)
    assert info.value.path == path
    assert info.value.what == what
    assert path in str(info.value)


def test_dtype_checked_only_when_asked() -> None:
    spec = TreeSpec.of(torch.zeros(2))
    spec.check(torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ShapeMismatchError, match="dtype mismatch"):
        spec.check(torch.zeros(2, dtype=torch.float64), check_dtype=True)


def test_numpy_is_converted_and_back() -> None:
    tree = as_tree({"a": np.ones((2, 2), dtype=np.float32), "b": [np.arange(3)]})
    assert isinstance(tree["a"], torch.Tensor) and isinstance(tree["b"][0], torch.Tensor)
    back = tree_to_numpy(tree)
    assert isinstance(back["a"], np.ndarray) and back["b"][0].tolist() == [0, 1, 2]
    with pytest.raises(TypeError, match=r"\['b'\]\[1\]"):
        as_tree({"b": [np.zeros(1), "nope"]})


def test_clone_is_deep_and_map_keeps_structure() -> None:
    tree = sample_tree()
    copy = clone_tree(tree)
    copy["layer1"]["bias"] += 1
    assert tree["layer1"]["bias"].tolist() == [6.0, 7.0]
    doubled = map_tree(lambda t: t * 2, tree)
    assert TreeSpec.of(doubled) == TreeSpec.of(tree)
    assert doubled["heads"][0].item() == 16.0


def test_flat_length_mismatch() -> None:
    spec = TreeSpec.of([torch.zeros(2)])
    with pytest.raises(ShapeMismatchError):
        spec.unflatten(torch.zeros(3))


@given(st.lists(st.lists(st.integers(0, 4), min_size=0, max_size=3), min_size=1, max_size=5))
def test_flatten_unflatten_property(shapes: list[list[int]]) -> None:
    tree = [torch.randn(tuple(s)) for s in shapes]
    spec = TreeSpec.of(tree)
    flat = flatten(tree)
    assert flat.numel() == sum(t.numel() for t in tree)
    for a, b in zip(spec.unflatten(flat), tree, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 64, 65, (128 << 10) + 3, 3 * (128 << 10)])
def test_copy_finite_copies_exactly_and_finds_every_nonfinite(
    dtype: torch.dtype, numel: int, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # fused: in chunks whatever the size (else only tensors of 32 MiB or more are)
    monkeypatch.setattr(trees, "_FUSED_MIN_BYTES", 0 if fused else 1 << 62)
    src = torch.randn(numel).to(dtype)
    dst = torch.empty_like(src)
    assert copy_finite(dst, src) and torch.equal(dst, src) and all_finite(src)
    # the largest finite values: every chunk's sum overflows, yet all are finite
    big = torch.full((numel,), torch.finfo(dtype).max, dtype=dtype)
    assert copy_finite(torch.empty_like(big), big) and all_finite(big)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in {0, numel // 2, numel - 1}:  # first, middle and last chunk
            u = src.clone()
            u[at] = bad
            out = torch.empty_like(u)
            assert not copy_finite(out, u) and not all_finite(u)
            assert torch.equal(out.isnan(), u.isnan()) and torch.equal(
                out.nan_to_num(), u.nan_to_num()
            )


def test_copy_finite_integers_and_shapes() -> None:
    src = torch.arange(12).reshape(3, 4)
    dst = torch.empty_like(src)
    assert copy_finite(dst, src) and torch.equal(dst, src)
