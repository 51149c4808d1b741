import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradhub import (
    DataParallelTrainer,
    ModelUpdate,
    ShapeMismatchError,
    WorkerUpdate,
    merge_worker_updates,
    split_batch,
)
from gradhub.train.strategies import make_strategy
from gradhub.train.strategies.sharded import ShardedStrategy

# ------------------------------------------------------------------ the seed's examples


def test_seed_split_8_over_4_gives_2_each() -> None:
    parts = DataParallelTrainer().split_batch(list(range(8)), 4)
    assert [len(p) for p in parts] == [2, 2, 2, 2]
    assert parts[0] == [0, 4]


def test_seed_split_10_over_3_gives_4_3_3() -> None:
    parts = DataParallelTrainer().split_batch(list(range(10)), 3)
    assert [len(p) for p in parts] == [4, 3, 3]
    assert parts == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]


def test_seed_merge_weighted_by_samples() -> None:
    update = DataParallelTrainer().merge_worker_updates(
        [
            WorkerUpdate(0, torch.tensor([4.0]), loss=2.0, samples_processed=1),
            WorkerUpdate(1, torch.tensor([0.0]), loss=0.0, samples_processed=3),
        ]
    )
    assert isinstance(update, ModelUpdate)
    assert torch.equal(update.averaged_gradients, torch.tensor([1.0]))
    assert update.mean_loss == 0.5
    assert update.total_samples == 4


# ------------------------------------------------------------------ split_batch forms


def test_split_fewer_samples_than_workers_gives_empty_parts() -> None:
    assert split_batch([1, 2], 4) == [[1], [2], [], []]
    assert split_batch([], 3) == [[], [], []]


def test_split_tensor_array_tuple_and_dict_consistently() -> None:
    x = torch.arange(10).reshape(5, 2)
    y = torch.arange(5) * 10
    parts = split_batch((x, y), 2)
    assert torch.equal(parts[0][0], x[[0, 2, 4]]) and torch.equal(parts[0][1], y[[0, 2, 4]])
    assert torch.equal(parts[1][1], torch.tensor([10, 30]))

    arr = np.arange(7)
    assert [p.tolist() for p in split_batch(arr, 3)] == [[0, 3, 6], [1, 4], [2, 5]]
    assert isinstance(split_batch(arr, 3)[0], np.ndarray)

    d = split_batch({"x": x, "y": y.numpy()}, 2)
    assert set(d[1]) == {"x", "y"} and d[1]["y"].tolist() == [10, 30]


def test_split_errors() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="n_workers"):
            split_batch([1, 2, 3], bad)
    with pytest.raises(ValueError, match="different first dimensions"):
        split_batch((torch.zeros(3), torch.zeros(4)), 2)
    with pytest.raises(TypeError):
        split_batch(42, 2)


@given(st.lists(st.integers()), st.integers(min_value=1, max_value=12))
def test_split_is_an_order_keeping_round_robin_partition(data: list[int], n: int) -> None:
    parts = split_batch(data, n)
    assert len(parts) == n
    # Each part keeps the original order and holds exactly the indices i % n == w.
    for w, part in enumerate(parts):
        assert part == [data[i] for i in range(w, len(data), n)]
    # Together they are the input, each element once: interleaving them back restores it.
    rebuilt = [parts[i % n][i // n] for i in range(len(data))]
    assert rebuilt == data
    sizes = [len(p) for p in parts]
    assert sum(sizes) == len(data) and max(sizes) - min(sizes) <= 1


# ------------------------------------------------------------------ merge properties

_update_lists = st.lists(
    st.tuples(
        st.lists(st.floats(-1e3, 1e3, width=32), min_size=3, max_size=3),
        st.floats(0, 10),
        st.integers(0, 50),
    ),
    min_size=1,
    max_size=8,
).filter(lambda us: sum(u[2] for u in us) > 0)


@settings(max_examples=60, deadline=None)
@given(_update_lists, st.randoms(use_true_random=False))
def test_merge_is_the_weighted_mean_and_order_free(raw, rnd: random.Random) -> None:
    updates = [
        WorkerUpdate(i, {"g": torch.tensor(g, dtype=torch.float32)}, loss, n)
        for i, (g, loss, n) in enumerate(raw)
    ]
    merged = merge_worker_updates(updates)
    total = sum(n for _, _, n in raw)
    expected = [math.fsum(g[j] * n for g, _, n in raw) / total for j in range(3)]
    # float64 accumulation, one rounding to fp32 at the end: within 1 ulp of fp32
    # (plus a tiny absolute slack for values that cancel to near zero).
    assert torch.allclose(
        merged.averaged_gradients["g"].double(),
        torch.tensor(expected, dtype=torch.float64),
        rtol=2**-23,
        atol=1e-9,
    )
    assert merged.mean_loss == pytest.approx(
        math.fsum(loss * n for _, loss, n in raw) / total, rel=1e-12, abs=1e-12
    )
    assert merged.total_samples == total

    shuffled = list(updates)
    rnd.shuffle(shuffled)
    again = merge_worker_updates(shuffled)
    assert torch.equal(again.averaged_gradients["g"], merged.averaged_gradients["g"])
    assert again.mean_loss == merged.mean_loss


def test_merge_tree_gradients_integer_input_and_zero_sample_worker() -> None:
    updates = [
        WorkerUpdate("a", [torch.tensor([2, 4]), {"b": np.array([1.0])}], 1.0, 2),
        WorkerUpdate("b", [torch.tensor([0, 0]), {"b": np.array([3.0])}], 3.0, 2),
        WorkerUpdate("idle", None, float("nan"), 0),  # contributes nothing, NaN loss ignored
    ]
    merged = merge_worker_updates(updates)
    first, second = merged.averaged_gradients
    assert torch.equal(first, torch.tensor([1.0, 2.0]))  # integer leaves come back fp32
    assert first.dtype == torch.float32
    assert torch.equal(second["b"], torch.tensor([2.0], dtype=torch.float64))
    assert merged.mean_loss == 2.0 and merged.total_samples == 4


# ------------------------------------------------------------------ every error case


def upd(wid, g=(1.0,), loss=0.0, n=1) -> WorkerUpdate:
    return WorkerUpdate(wid, torch.tensor(g), loss, n)


def test_merge_empty_input_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one"):
        merge_worker_updates([])


def test_merge_zero_total_samples_names_the_workers() -> None:
    with pytest.raises(ValueError, match=r"total samples is 0 \(workers 'w0', 'w1'\)"):
        merge_worker_updates([upd("w0", n=0), upd("w1", n=0)])


def test_merge_negative_samples_names_the_worker() -> None:
    with pytest.raises(ValueError, match="worker 'w1': samples_processed is negative"):
        merge_worker_updates([upd("w0"), upd("w1", n=-2)])


def test_merge_non_integer_samples_names_the_worker() -> None:
    with pytest.raises(TypeError, match="worker 'w1'"):
        merge_worker_updates([upd("w0"), upd("w1", n=1.5)])


def test_merge_duplicate_worker_id_names_it() -> None:
    with pytest.raises(ValueError, match="worker 7 appears twice"):
        merge_worker_updates([upd(7), upd(3), upd(7)])


def test_merge_shape_mismatch_names_the_worker() -> None:
    with pytest.raises(ShapeMismatchError, match="worker 'w2'") as info:
        merge_worker_updates([upd("w1", g=(1.0, 2.0)), upd("w2", g=(1.0, 2.0, 3.0))])
    assert info.value.expected == [2] and info.value.received == [3]


def test_merge_structure_mismatch_names_the_worker_and_path() -> None:
    good = WorkerUpdate(0, {"w": torch.ones(2), "b": torch.ones(1)}, 0.0, 1)
    bad = WorkerUpdate(1, {"w": torch.ones(2)}, 0.0, 1)
    with pytest.raises(ShapeMismatchError, match="structure mismatch at worker 1"):
        merge_worker_updates([good, bad])
    zero_but_wrong = WorkerUpdate(2, {"w": torch.ones(3), "b": torch.ones(1)}, 0.0, 0)
    with pytest.raises(ShapeMismatchError, match=r"worker 2 \['w'\]"):
        merge_worker_updates([good, zero_but_wrong])


def test_trainer_constructor_keeps_job_arguments_for_its_strategy() -> None:
    model = torch.nn.Linear(2, 1)
    trainer = DataParallelTrainer(model, None, strategy="sharded", compress="bf16")
    assert trainer.model is model and trainer.strategy == "sharded"
    # The options are the strategy's own: they build it, with compress="bf16".
    built = make_strategy(trainer.strategy, **trainer.options)
    assert isinstance(built, ShardedStrategy) and built.config.compress == "bf16"
    # A strategy instance carries its options: more of them are refused.
    with pytest.raises(TypeError, match="strategy's constructor"):
        DataParallelTrainer(model, None, strategy=built, compress="fp16")
    # An option the strategy does not have is refused when it is built.
    with pytest.raises(TypeError, match="bucket"):
        make_strategy("sharded", bucket="big")
