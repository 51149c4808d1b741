"""``sharded`` runs a DDP script's lines as DDP does (2 real ranks against one
process on the combined batch), or refuses them at ``prepare``.

Tolerance: the two ranks' gradients are halved (a power of two: exact) and
summed in float32, the reference's autograd accumulates the same two halved
terms; the sums can differ in their last bit at most, and each step's
update in float32 rounding: 1e-6 on parameters of order 1 over 4 steps.
"""

from __future__ import annotations

import functools
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import gradhub
from gradhub.collective.sharded_optimizer import ELEMENTWISE
from gradhub.errors import StateError, UnsupportedByStrategyError
from gradhub.train.strategies import sharded_state
from harness import run_ranks
from sharded_conformance_jobs import (
    STEPS,
    Net,
    adamw,
    bf16_reference,
    from_bytes,
    job,
    reference,
    sgd,
)

ATOL = 1e-6  # see the module docstring


def _close(got: list[np.ndarray], want: list[np.ndarray], atol: float = ATOL) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol)


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return reference(range(STEPS + 2))


@pytest.fixture(scope="module")
def results(ref: dict[str, Any]) -> list[dict[str, Any]]:
    return [r.value for r in run_ranks(job, 2, ref["states"][2], timeout=240)]


@pytest.mark.slow
def test_torch_clip_sees_the_combined_gradient(
    results: list[dict[str, Any]], ref: dict[str, Any]
) -> None:
    names = [n for n, _ in Net().named_parameters()]
    for rank in (0, 1):
        got = results[rank]["torch clip"]
        # torch's clip on model.parameters() returned the global norm and clipped
        # the gradient the step used (before: the local norm, and no clipping).
        np.testing.assert_allclose(got["norms"], ref["norms"][:STEPS], rtol=1e-6)
        for step in range(STEPS):
            _close(got["params"][step], ref["params"][step])
            # unused everywhere: .grad None; used by rank 0 only: rank 1 holds it too
            none = dict(zip(names, got["none"][step], strict=True))
            assert none["unused.weight"] and none["unused.bias"]
            assert not none["extra.weight"] and not none["extra.bias"]
        # AdamW with weight decay left the unused parameter as it was, bit for bit.
        initial = dict(zip(names, [p.detach().numpy() for p in Net().parameters()], strict=True))
        final = dict(zip(names, got["params"][-1], strict=True))
        assert np.array_equal(final["unused.weight"], initial["unused.weight"])
        assert np.array_equal(final["unused.bias"], initial["unused.bias"])
        # gradhub.clip_grad_norm_ is torch's clip on the same gradients: same bits.
        other = results[rank]["gradhub clip"]
        assert other["norms"] == got["norms"]
        for a, b in zip(other["params"][-1], got["params"][-1], strict=True):
            assert np.array_equal(a, b)
    # After backward .grad holds the combined gradient: the same bits on both ranks.
    for step in range(STEPS):
        for a, b in zip(
            results[0]["torch clip"]["grads"][step],
            results[1]["torch clip"]["grads"][step],
            strict=True,
        ):
            assert (a is None and b is None) or np.array_equal(a, b)
    # With a bf16 wire every rank decodes the same gathered bytes: same bits too.
    for a, b in zip(
        results[0]["bf16 wire"]["grads"], results[1]["bf16 wire"]["grads"], strict=True
    ):
        for x, y in zip(a, b, strict=True):
            assert np.array_equal(x, y)


@pytest.mark.slow
def test_torch_grad_scaler_with_a_skipped_step(results: list[dict[str, Any]]) -> None:
    want = reference(range(STEPS), sgd, scaler=True)
    for rank in (0, 1):
        got = results[rank]["scaler"]
        # Step 1 overflowed on rank 1 only: skipped on both, the scale halved.
        assert got["scales"] == want["scales"] == [2.0**10, 2.0**10, 2.0**9, 2.0**9]
        for a, b in zip(got["params"][1], got["params"][0], strict=True):
            assert np.array_equal(a, b)
        # unscale_ reached the gradient the step used (before: 1024x, a difference of 188).
        for step in range(STEPS):
            _close(got["params"][step], want["params"][step])


@pytest.mark.slow
def test_bf16_parameters_train_on_fp32_master_slices(results: list[dict[str, Any]]) -> None:
    want = bf16_reference()
    for rank in (0, 1):
        for got, ref_step in zip(results[rank]["bf16 parameters"], want, strict=True):
            # The halves' bf16 gradients summed in fp32 and rounded once, as bf16
            # autograd adds them; the fp32 master steps may round differently
            # by one bf16 unit (2**-8 relative).
            for g, w in zip(got, ref_step, strict=True):
                np.testing.assert_allclose(g, w, rtol=2.0**-7, atol=1e-6)


@pytest.mark.slow
def test_every_elementwise_torch_optimizer_trains_as_on_one_process(
    results: list[dict[str, Any]],
) -> None:
    assert set(results[0]["optimizers"]) == ELEMENTWISE
    for name in sorted(ELEMENTWISE):
        cls = getattr(torch.optim, name)
        want = reference(range(2), lambda m, c=cls: c(m.parameters(), lr=0.01), clip=False)
        for rank in (0, 1):
            got = results[rank]["optimizers"][name]
            for step in range(2):
                # Rprop and Adam-like updates of an element near 0 amplify the last
                # bit of a gradient: float32 rounding, 1e-5.
                _close(got[step], want["params"][step], atol=1e-5)


@pytest.mark.slow
def test_rank0_alone_state_dict_is_the_plain_optimizers(
    results: list[dict[str, Any]], ref: dict[str, Any]
) -> None:
    final = from_bytes(results[0]["torch clip"]["final state"])[1]
    after = from_bytes(results[0]["torch clip"]["after close"])
    for i, entry in final["state"].items():  # asked after rank 1 closed: the same state
        for key, value in entry.items():
            assert torch.equal(after["state"][i][key], value)
    weights, state = from_bytes(results[0]["torch clip"]["state at 2"])
    want_weights, want = from_bytes(ref["states"][2])
    assert state["param_groups"] == want["param_groups"]
    assert sorted(state["state"]) == sorted(want["state"]) == [0, 1, 3, 4, 5, 7]  # no unused
    for i, entry in want["state"].items():
        assert sorted(state["state"][i]) == sorted(entry)
        for key, value in entry.items():
            torch.testing.assert_close(state["state"][i][key], value, rtol=0, atol=ATOL)
    for key, value in want_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=ATOL)
    # Plain torch loads the files and trains on as the reference does.
    plain = Net()
    plain.load_state_dict(weights)
    opt = adamw(plain)
    opt.load_state_dict(state)
    resumed = reference(range(2, STEPS), start=results[0]["torch clip"]["state at 2"])
    _close(resumed["params"][-1], ref["params"][STEPS - 1])


@pytest.mark.slow
def test_checkpoints_resume_in_every_order(
    results: list[dict[str, Any]], ref: dict[str, Any]
) -> None:
    for rank in (0, 1):
        for order in ("before prepare", "after prepare"):
            got = results[rank]["resume"][order]
            for i, step in enumerate(range(2, STEPS)):
                _close(got[i], ref["params"][step])
        # the sharded job's final state, resumed under allreduce, 2 more steps
        got = results[rank]["another strategy"]
        for i, step in enumerate(range(STEPS, STEPS + 2)):
            _close(got[i], ref["params"][step], atol=2 * ATOL)


@pytest.mark.slow
def test_state_responder_chunks_and_names_a_rank_that_does_not_answer(
    results: list[dict[str, Any]],
) -> None:
    out = results[0]["responder"]
    assert out["answer"]  # a 9 MiB shard came through the store in chunks
    missing, message = out["timeout"]
    assert missing == [1]
    assert "optimizer.state_dict() on rank 0 timed out after 2s waiting for rank(s) 1" in message


@pytest.mark.slow
def test_state_dict_between_backward_and_step_is_refused_and_changes_nothing(
    results: list[dict[str, Any]],
) -> None:
    for r in results:
        assert "between backward() and step() under strategy 'sharded'" in r["between"]["refused"]
    first, second = (from_bytes(r["between"]["after"])["state"] for r in results)
    assert first.keys() == second.keys() and 0 in first
    for k, state in first.items():
        for key, value in state.items():
            assert torch.equal(value, second[k][key]), (k, key)
    assert float(first[0]["step"]) == 2.0
    _close(results[0]["between"]["params"], results[1]["between"]["params"], atol=0.0)


def test_a_slice_answered_after_another_step_is_an_error_not_a_mixed_state() -> None:
    """The requester's check of the step counts, with rank 1's answer made up."""
    slice_opt = SimpleNamespace(
        lock=threading.Lock(), steps=3, pieces=[], optimizer=SimpleNamespace(state={})
    )
    answers = {3: sharded_state.to_bytes(3, []), 4: sharded_state.to_bytes(4, [])}
    for steps, answer in answers.items():
        responder = SimpleNamespace(rank=0, request=lambda what, a=answer: {1: a})
        call = functools.partial(
            sharded_state.every_rank_pieces, slice_opt, responder, between=False
        )
        if steps == 3:
            assert call() == []
        else:
            with pytest.raises(StateError, match="rank 1's slice is after 4 step"):
                call()


class _MySGD(torch.optim.SGD):
    pass


def test_refused_at_prepare_naming_allreduce() -> None:
    def linear() -> nn.Module:
        return nn.Linear(4, 4, bias=False)

    cases = {
        "LBFGS": lambda m: torch.optim.LBFGS(m.parameters()),
        "Adafactor": lambda m: torch.optim.Adafactor(m.parameters(), lr=0.01),
        "Muon": lambda m: torch.optim.Muon(m.parameters(), lr=0.01),
        "SparseAdam": lambda m: torch.optim.SparseAdam(m.parameters(), lr=0.01),
        "_MySGD": lambda m: _MySGD(m.parameters(), lr=0.01),
    }
    with gradhub.init(timeout=10) as runtime:
        for name, make in cases.items():
            model = linear()
            with pytest.raises(UnsupportedByStrategyError, match=name) as info:
                gradhub.prepare(model, make(model), strategy="sharded", runtime=runtime)
            assert 'strategy="allreduce"' in str(info.value)
        model = nn.Sequential(linear(), linear().to(torch.bfloat16))
        with pytest.raises(UnsupportedByStrategyError, match=r"(?s)bfloat16, torch.float32"):
            gradhub.prepare(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                strategy="sharded",
                runtime=runtime,
            )
        two = nn.Sequential(linear(), linear())
        first = torch.optim.SGD(two[0].parameters(), lr=0.1)
        second = torch.optim.Adam(two[1].parameters(), lr=0.1)
        with pytest.raises(UnsupportedByStrategyError, match="allreduce"):
            gradhub.prepare(two, [first, second], strategy="sharded", runtime=runtime)
        with pytest.raises(UnsupportedByStrategyError, match="allreduce"):
            gradhub.prepare(two, first, strategy="sharded", runtime=runtime)
