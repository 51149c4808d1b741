import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from gradhub import (
    ClosedError,
    DuplicateParameterError,
    LocalParameterServer,
    ShapeMismatchError,
    UnknownParameterError,
)
from gradhub.ps.server.store import ParameterStore


class CountingSGD(torch.optim.SGD):
    """SGD that counts its steps, to prove one update per push."""

    steps = 0

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        CountingSGD.steps += 1
        return super().step(closure)


@pytest.fixture
def ps() -> Iterator[LocalParameterServer]:
    with LocalParameterServer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) as server:
        yield server


def test_one_push_of_two_replicas_moves_by_lr_times_sum_in_one_step() -> None:
    CountingSGD.steps = 0
    lr = 0.1
    with LocalParameterServer(optimizer=lambda p: CountingSGD(p, lr=lr)) as ps:
        w = torch.tensor([1.0, 2.0, 3.0])
        ps.init("w", [w, w.clone()])
        g = torch.tensor([1.0, -1.0, 0.5])
        ps.push("w", [g, g.clone()]).result(timeout=10)
        assert CountingSGD.steps == 1
        assert ps.store.steps("w") == 1
        assert torch.allclose(ps.get("w"), w - lr * 2 * g)
        assert torch.equal(w, torch.tensor([1.0, 2.0, 3.0]))  # init copied, caller untouched


def test_pull_fills_every_replica(ps: LocalParameterServer) -> None:
    ps.init("w", torch.arange(4.0))
    replicas = [torch.zeros(4), torch.zeros(4), torch.full((4,), 9.0)]
    ps.pull("w", replicas).result(timeout=10)
    for r in replicas:
        assert torch.equal(r, torch.arange(4.0))


def test_pull_sees_the_same_clients_earlier_pushes(ps: LocalParameterServer) -> None:
    ps.init("w", torch.zeros(2))
    out = torch.empty(2)
    for _ in range(20):
        ps.push("w", torch.ones(2))
    ps.pull("w", out).result(timeout=10)  # not awaited: the pushes before it still apply first
    assert torch.allclose(out, torch.full((2,), -2.0))


def test_push_snapshots_the_gradient_at_call_time(ps: LocalParameterServer) -> None:
    ps.init("w", torch.zeros(2))
    g = torch.ones(2)
    fut = ps.push("w", g)
    g.fill_(100.0)  # reusing the buffer at once must not change the pushed value
    fut.result(timeout=10)
    assert torch.allclose(ps.get("w"), torch.full((2,), -0.1))


def test_numpy_values_are_accepted(ps: LocalParameterServer) -> None:
    ps.init("w", np.zeros(3, dtype=np.float32))
    ps.push("w", np.ones(3, dtype=np.float32)).result(timeout=10)
    assert torch.allclose(ps.get("w"), torch.full((3,), -0.1))


def test_adam_state_is_per_key() -> None:
    with LocalParameterServer(optimizer=lambda p: torch.optim.Adam(p, lr=0.1)) as ps:
        ps.init("a", torch.zeros(2))
        ps.init("b", torch.zeros(2))
        for _ in range(3):
            ps.push("a", torch.ones(2))
        ps.push("b", torch.ones(2)).result(timeout=10)
        ps.pull("a", torch.empty(2)).result(timeout=10)
        opt_a, opt_b = ps.store.optimizer("a"), ps.store.optimizer("b")
        assert opt_a is not opt_b
        assert opt_a is not None and opt_b is not None
        state_a = next(iter(opt_a.state.values()))
        state_b = next(iter(opt_b.state.values()))
        assert float(state_a["step"]) == 3.0 and float(state_b["step"]) == 1.0
        # Adam's first step moves by lr whatever the gradient: "b" saw one step,
        # "a" three, so their values differ.
        assert torch.allclose(ps.get("b"), torch.full((2,), -0.1))
        assert torch.allclose(ps.get("a"), torch.full((2,), -0.3), atol=1e-6)


def test_priorities_order_queued_operations() -> None:
    order: list[str] = []
    with LocalParameterServer(optimizer=lambda p: torch.optim.SGD(p, lr=1.0)) as ps:
        for key in ("block", "low", "mid", "high", "tie1", "tie2"):
            ps.init(key, torch.zeros(1))
        # Holding the store lock keeps the worker thread from running anything, so
        # everything below is queued together. The worker may already have taken
        # one "block" op (the highest priority) and waits for the lock with it.
        blocker = ps.pull("block", torch.zeros(1))
        ps._store_lock.acquire()
        try:
            blocker2 = ps.push("block", torch.ones(1), priority=100)
            futures = {
                "low": ps.push("low", torch.ones(1), priority=-5),
                "tie1": ps.push("tie1", torch.ones(1), priority=0),
                "mid": ps.push("mid", torch.ones(1), priority=1),
                "tie2": ps.push("tie2", torch.ones(1), priority=0),
                "high": ps.push("high", torch.ones(1), priority=10),
            }
            for name, fut in futures.items():
                fut.add_done_callback(lambda _f, name=name: order.append(name))
        finally:
            ps._store_lock.release()
        blocker.result(timeout=10)
        blocker2.result(timeout=10)
        for fut in futures.values():
            fut.result(timeout=10)
    # Higher priority first, FIFO among equals (tie1 was submitted before tie2).
    assert order == ["high", "mid", "tie1", "tie2", "low"]


def test_priority_never_reorders_one_key() -> None:
    with LocalParameterServer(optimizer=None) as ps:  # no optimizer: push replaces the value
        ps.init("w", torch.zeros(1))
        ps.init("x", torch.zeros(1))
        seen = torch.empty(1)
        ps._store_lock.acquire()
        try:
            ps.push("x", torch.ones(1), priority=50)  # a queued op on another key
            ps.push("w", torch.full((1,), 7.0), priority=-10)
            pull = ps.pull("w", seen, priority=100)  # urgent, but after the push on "w"
        finally:
            ps._store_lock.release()
        pull.result(timeout=10)
        assert torch.equal(seen, torch.tensor([7.0]))


def test_errors_are_typed_raised_at_call_time_and_change_nothing(ps: LocalParameterServer) -> None:
    ps.init("w", torch.ones(3))
    state = ps.state_dict()
    with pytest.raises(UnknownParameterError, match="'nope'"):
        ps.push("nope", torch.ones(3))
    with pytest.raises(UnknownParameterError):
        ps.pull("nope", torch.ones(3))
    with pytest.raises(KeyError):  # UnknownParameterError is a KeyError too
        ps.pull("nope", torch.ones(3))
    with pytest.raises(DuplicateParameterError, match="already initialised"):
        ps.init("w", torch.zeros(3))
    with pytest.raises(ShapeMismatchError, match="shape mismatch"):
        ps.push("w", torch.ones(4))
    with pytest.raises(ShapeMismatchError, match="dtype mismatch"):
        ps.push("w", torch.ones(3, dtype=torch.float64))
    with pytest.raises(ShapeMismatchError):
        ps.pull("w", [torch.ones(3), torch.ones(2)])  # replicas disagree
    with pytest.raises(ShapeMismatchError):
        ps.init("v", [torch.ones(3), torch.ones(3, dtype=torch.float16)])
    assert ps.keys() == ["w"]
    assert ps.pending == 0
    assert torch.equal(ps.get("w"), state["values"]["w"])


def test_use_after_close_is_refused() -> None:
    ps = LocalParameterServer()
    ps.init("w", torch.zeros(1))
    fut = ps.push("w", torch.ones(1))
    ps.close()
    assert fut.done()  # close ran what was queued
    ps.close()  # idempotent
    for call in (
        lambda: ps.init("v", torch.zeros(1)),
        lambda: ps.push("w", torch.ones(1)),
        lambda: ps.pull("w", torch.ones(1)),
    ):
        with pytest.raises(ClosedError):
            call()
    assert torch.equal(ps.get("w"), torch.ones(1))  # still readable, unchanged


def test_state_dict_round_trip_keeps_optimizer_state() -> None:
    def factory(p):
        return torch.optim.SGD(p, lr=0.1, momentum=0.9)

    with LocalParameterServer(optimizer=factory) as a:
        a.init("w", torch.zeros(2))
        for _ in range(3):
            a.push("w", torch.ones(2))
        a.pull("w", torch.empty(2)).result(timeout=10)
        saved = a.state_dict()
        a.push("w", torch.ones(2)).result(timeout=10)
        expected_next = a.get("w")

    with LocalParameterServer(optimizer=factory) as b:
        b.load_state_dict(saved)
        assert b.store.steps("w") == 3
        b.push("w", torch.ones(2)).result(timeout=10)
        # Same momentum buffer restored, so the 4th step matches exactly.
        assert torch.equal(b.get("w"), expected_next)


def test_load_state_dict_checks_before_changing() -> None:
    store = ParameterStore(lambda p: torch.optim.SGD(p, lr=1.0))
    store.init("a", torch.zeros(2))
    store.init("b", torch.zeros(2))
    bad = {"values": {"a": torch.ones(2), "b": torch.ones(5)}, "optimizers": {}}
    with pytest.raises(ShapeMismatchError):
        store.load_state_dict(bad)
    assert torch.equal(store.value("a"), torch.zeros(2))


def test_concurrent_clients_lose_no_push() -> None:
    with LocalParameterServer(optimizer=lambda p: torch.optim.SGD(p, lr=1.0)) as ps:
        ps.init("w", torch.zeros(1, dtype=torch.float64))

        def client() -> None:
            for _ in range(200):
                ps.push("w", torch.ones(1, dtype=torch.float64))

        threads = [threading.Thread(target=client) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ps.pull("w", torch.empty(1, dtype=torch.float64)).result(timeout=10)
        assert ps.get("w").item() == -800.0
        assert ps.store.steps("w") == 800
