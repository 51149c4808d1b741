import threading
import time

import numpy as np
import pytest
import torch

from gradhub import (
    ClosedError,
    DistributedGradientsCoordinator,
    NonFiniteError,
    ShapeMismatchError,
    StateError,
)


def make(mode: str = "descent", lr: float = 1.0, params=None) -> DistributedGradientsCoordinator:
    coord = DistributedGradientsCoordinator(mode, learning_rate=lr)
    coord.set_model_parameters(torch.zeros(3) if params is None else params)
    return coord


def test_descent_and_ascent_with_learning_rate() -> None:
    down = make("descent", lr=0.5)
    down.add_gradients(torch.tensor([1.0, 2.0, -4.0]))
    assert down.apply_pending() == 1
    assert torch.equal(down.get_model_parameters(), torch.tensor([-0.5, -1.0, 2.0]))

    up = make("Ascent", lr=0.5)  # the seed spells modes with a capital
    up.add_gradients(torch.tensor([1.0, 2.0, -4.0]))
    up.apply_pending()
    assert torch.equal(up.get_model_parameters(), torch.tensor([0.5, 1.0, -2.0]))


def test_unknown_mode_and_bad_learning_rate_fail_at_once() -> None:
    with pytest.raises(ValueError, match="descent"):
        DistributedGradientsCoordinator("sideways")
    with pytest.raises(ValueError, match="learning_rate"):
        DistributedGradientsCoordinator(learning_rate=float("nan"))


def test_set_parameters_none_keeps_current_value() -> None:
    coord = make("descent", lr=2.0)
    coord.set_parameters(gradient_change_mode="ascent")
    assert (coord.gradient_change_mode, coord.learning_rate) == ("ascent", 2.0)
    coord.set_parameters(learning_rate=0.25)
    assert (coord.gradient_change_mode, coord.learning_rate) == ("ascent", 0.25)
    coord.add_gradients(torch.ones(3))
    coord.apply_pending()
    assert torch.equal(coord.get_model_parameters(), torch.full((3,), 0.25))


def test_fifo_order_is_visible_through_on_applied_and_values() -> None:
    seen: list[int] = []
    coord = DistributedGradientsCoordinator(learning_rate=1.0, on_applied=seen.append)
    # Gradient k touches slot k only, so each intermediate state shows which
    # gradients were applied so far: FIFO means a growing prefix.
    coord.set_model_parameters(torch.zeros(5))
    seqs = []
    for k in range(5):
        g = torch.zeros(5)
        g[k] = float(k + 1)
        seqs.append(coord.add_gradients(g))
    live = coord.get_model_parameters(copy=False)
    snapshots = []
    while coord.pending:
        coord._apply_one()
        snapshots.append(live.clone())
    assert seen == seqs == [1, 2, 3, 4, 5]
    for k, snap in enumerate(snapshots):
        expected = torch.tensor([-(i + 1.0) if i <= k else 0.0 for i in range(5)])
        assert torch.equal(snap, expected)


def test_tree_parameters_and_numpy_gradients() -> None:
    params = {
        "layer1": {"weight": torch.ones(2, 2), "bias": torch.zeros(2)},
        "out": [torch.ones(1)],
    }
    coord = make(params=params)
    grads = {
        "layer1": {"bias": np.ones(2, dtype=np.float32), "weight": np.ones((2, 2))},
        "out": [np.array([3.0])],
    }
    coord.add_gradients(grads)
    coord.apply_pending()
    got = coord.get_model_parameters()
    assert torch.equal(got["layer1"]["weight"], torch.zeros(2, 2))
    assert torch.equal(got["layer1"]["bias"], -torch.ones(2))
    assert torch.equal(got["out"][0], torch.tensor([-2.0]))
    assert got["layer1"]["weight"].dtype == torch.float32


def test_copy_true_isolates_and_copy_false_shares() -> None:
    mine = torch.zeros(3)
    copied = make(params=mine)
    copied.add_gradients(torch.ones(3))
    copied.apply_pending()
    assert torch.equal(mine, torch.zeros(3))  # caller's tensor untouched
    snapshot = copied.get_model_parameters(copy=True)
    snapshot += 100
    assert torch.equal(copied.get_model_parameters(), -torch.ones(3))

    shared = DistributedGradientsCoordinator()
    shared.set_model_parameters(mine, copy=False)
    shared.add_gradients(torch.ones(3))
    shared.apply_pending()
    assert torch.equal(mine, -torch.ones(3))  # updated in place
    assert shared.get_model_parameters(copy=False) is mine


def test_copy_false_updates_nn_parameters_in_place() -> None:
    layer = torch.nn.Linear(2, 1)
    before = layer.weight.detach().clone()
    coord = DistributedGradientsCoordinator(learning_rate=0.1)
    coord.set_model_parameters(list(layer.parameters()), copy=False)
    coord.add_gradients([torch.ones(1, 2), torch.ones(1)])
    coord.apply_pending()
    assert torch.allclose(layer.weight.detach(), before - 0.1)


@pytest.mark.parametrize(
    ("bad", "path"),
    [
        ({"a": torch.ones(2)}, "<root>"),  # missing key
        ({"a": torch.ones(2), "b": [torch.ones(4)]}, "['b'][0]"),  # wrong shape
        ({"a": torch.ones(2), "b": torch.ones(3)}, "['b']"),  # wrong structure
    ],
)
def test_bad_structure_or_shape_is_refused_and_nothing_changes(bad, path) -> None:
    coord = make(params={"a": torch.zeros(2), "b": [torch.zeros(3)]})
    with pytest.raises(ShapeMismatchError) as info:
        coord.add_gradients(bad)
    assert info.value.path == path
    assert (coord.pending, coord.rejected, coord.applied) == (0, 1, 0)
    assert coord.apply_pending() == 0
    assert torch.equal(coord.get_model_parameters()["a"], torch.zeros(2))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_gradient_is_refused_or_skipped(value: float) -> None:
    coord = make()
    with pytest.raises(NonFiniteError, match="NaN or infinity"):
        coord.add_gradients(torch.tensor([0.0, value, 1.0]))
    assert coord.add_gradients(torch.tensor([value, 0, 0]), nonfinite="skip") is None
    assert (coord.pending, coord.rejected) == (0, 2)

    skipping = DistributedGradientsCoordinator(nonfinite="skip")
    skipping.set_model_parameters(torch.zeros(3))
    assert skipping.add_gradients(torch.tensor([value, 0, 0])) is None
    assert skipping.add_gradients(torch.ones(3)) == 1
    skipping.apply_pending()
    assert torch.equal(skipping.get_model_parameters(), -torch.ones(3))


def test_start_without_parameters_or_twice_is_an_error() -> None:
    empty = DistributedGradientsCoordinator()
    with pytest.raises(StateError, match="set_model_parameters"):
        empty.start()
    with pytest.raises(StateError):
        empty.add_gradients(torch.ones(1))
    coord = make()
    thread = coord.start()
    assert thread.is_alive()
    with pytest.raises(StateError, match="already running"):
        coord.start()
    coord.stop()
    assert not thread.is_alive()
    coord.stop()  # idempotent
    coord.start()  # restartable after stop
    coord.stop()


def test_stop_drains_the_queue() -> None:
    coord = make()
    # Hold the params lock so the thread cannot apply until every gradient is queued.
    with coord._params_lock:
        coord.start()
        for _ in range(50):
            coord.add_gradients(torch.ones(3))
    coord.stop(drain=True)
    assert (coord.applied, coord.pending) == (50, 0)
    assert torch.equal(coord.get_model_parameters(), torch.full((3,), -50.0))


def test_stop_without_drain_leaves_the_queue_and_clear_counts() -> None:
    coord = make()
    with coord._params_lock:  # the thread is held before its first apply
        coord.start()
        for _ in range(10):
            coord.add_gradients(torch.ones(3))
        stopper = threading.Thread(target=coord.stop, kwargs={"drain": False})
        stopper.start()
        deadline = time.monotonic() + 10
        while not coord._stopping and time.monotonic() < deadline:
            time.sleep(0.001)
    stopper.join(10)
    assert not coord.running
    # At most the one gradient the thread had already reached was applied.
    assert coord.applied in (0, 1)
    assert coord.applied + coord.pending == 10
    assert coord.clear_gradients() == 10 - coord.applied
    assert coord.pending == 0
    assert coord.clear_gradients() == 0


def test_thread_wakes_per_gradient_in_real_time() -> None:
    coord = make()
    with coord:
        seq = coord.add_gradients(torch.ones(3))
        assert seq is not None
        coord.wait_applied(seq, timeout=10)
        assert coord.applied == 1
        assert torch.equal(coord.get_model_parameters(), -torch.ones(3))
        coord.add_gradients(torch.ones(3))
    assert coord.applied == 2  # exit drained


def test_eight_threads_thousand_gradients_each_exact() -> None:
    params = {"w": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(2, dtype=torch.float64)}
    coord = make(params=params)
    n_threads, per_thread = 8, 1000

    def worker(rank: int) -> None:
        # Distinct integer-valued gradients: every partial sum is exact in float64,
        # so any lost, duplicated or torn update changes the result.
        for i in range(per_thread):
            value = float(rank * per_thread + i + 1)
            coord.add_gradients({"w": torch.full((4,), value), "b": torch.tensor([1.0, value])})

    with coord:
        threads = [threading.Thread(target=worker, args=(r,)) for r in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    total = n_threads * per_thread
    expected = float(total * (total + 1) // 2)
    got = coord.get_model_parameters()
    assert coord.applied == total
    assert torch.equal(got["w"], torch.full((4,), -expected, dtype=torch.float64))
    assert torch.equal(got["b"], torch.tensor([-float(total), -expected], dtype=torch.float64))


def test_snapshots_are_consistent_while_applying() -> None:
    # Every gradient moves both leaves by the same amount; a torn snapshot would
    # show them differ.
    coord = make(params=[torch.zeros(1000), torch.zeros(1000)])
    torn = []
    with coord:
        for _ in range(300):
            coord.add_gradients([torch.ones(1000), torch.ones(1000)])
            a, b = coord.get_model_parameters()
            if not torch.equal(a, b) or not torch.equal(a, a[0].expand_as(a)):
                torn.append((a[0].item(), b[0].item()))
    assert torn == []


def test_set_model_parameters_with_new_structure_while_queued_is_refused() -> None:
    coord = make()
    coord.add_gradients(torch.ones(3))
    with pytest.raises(StateError, match="clear_gradients"):
        coord.set_model_parameters(torch.zeros(4))
    coord.set_model_parameters(torch.full((3,), 5.0))  # same structure is fine
    coord.apply_pending()
    assert torch.equal(coord.get_model_parameters(), torch.full((3,), 4.0))


def test_close_refuses_further_use() -> None:
    coord = make()
    coord.start()
    coord.add_gradients(torch.ones(3))
    coord.close()
    coord.close()
    assert coord.applied == 1
    with pytest.raises(ClosedError):
        coord.add_gradients(torch.ones(3))
    with pytest.raises(ClosedError):
        coord.start()


def test_large_finite_values_whose_sum_overflows_are_accepted() -> None:
    # The fast finiteness check sums the gradient; an overflowing sum of finite
    # values must fall back to the exact check, not refuse the gradient.
    coord = make(params=torch.zeros(4))
    assert coord.add_gradients(torch.full((4,), 3e38)) == 1
    with pytest.raises(NonFiniteError):
        coord.add_gradients(torch.tensor([3e38, 3e38, float("inf"), 0.0]))
    assert coord.pending == 1
