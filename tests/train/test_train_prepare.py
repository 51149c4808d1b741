"""``gradhub.prepare``: the user's own loop under every strategy (real processes)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import gradhub
from gradhub.errors import NotPreparedError, OptimizerMismatchError
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.launch import ServerHandle, start_server
from harness import run_ranks
from prepare_jobs import (
    compiled,
    fit_sharded,
    from_bytes,
    misuse_and_uneven,
    mlp,
    own_loop,
    params,
    plain_steps,
    sharded_resume,
    sharded_save,
    single_process,
    single_process_run,
    train,
    two_groups,
    uneven_reference,
)


@pytest.fixture
def sync_server() -> Iterator[ServerHandle]:
    with start_server(ServerConfig(mode="sync", workers=2)) as handle:  # takes the script's spec
        yield handle


def _same(got: list[np.ndarray], want: list[np.ndarray], atol: float) -> None:
    for g, w in zip(got, want, strict=True):
        if atol == 0:
            assert np.array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=0, atol=atol)


@pytest.mark.slow
def test_own_loop_matches_ddp_and_single_process(sync_server: ServerHandle) -> None:
    cases = [
        ("allreduce", "mlp", "sgd", {"bucket_mb": 0.0005}),  # several buckets, overlapped
        ("allreduce", "cnn", "sgd", {}),
        ("sharded", "mlp", "sgd", {}),
        ("sharded", "mlp", "sgd", {"bucket_mb": 0.0005}),  # several buckets, overlapped
        ("sharded", "cnn", "sgd", {}),
        ("allreduce", "mlp", "sgd", {"compress": "bf16"}),
        ("allreduce", "mlp", "sgd", {"compress": "fp16"}),
        ("ps-sync", "mlp", "adam", {"servers": [sync_server.address], "timeout": 30}),
    ]
    results = run_ranks(own_loop, 2, cases, timeout=150)
    for r in results:
        out = r.value
        for kind in ("mlp", "cnn"):
            # Same bucketing of the same sums as DDP (grad / 2, then sum): the same bits.
            _same(out[f"allreduce/{kind}"], out[f"ddp/{kind}"], atol=0)
            # Slices summed and normed separately: float32 rounding only.
            _same(out[f"sharded/{kind}"], out[f"ddp/{kind}"], atol=1e-5)
        # Reduce-scatters of buckets started during backward: every element summed
        # by its owner in the same order as in one reduce-scatter: the same bits.
        _same(out["sharded/mlp/buckets"], out["sharded/mlp"], atol=0)
        # The servers ran the script's Adam on the summed halves: the single-process
        # Adam on the 6-sample batches, same schedule, up to float32 rounding.
        _same(out["ps-sync/mlp"], single_process("mlp", "adam", 2), atol=1e-5)
        # 16-bit buckets: equal bits on every rank (checked in the job), close to DDP;
        # each bucket element is rounded to 8 (bf16) or 11 (fp16) significant bits.
        _same(out["allreduce/mlp/bf16"], out["ddp/mlp"], atol=2e-2)
        _same(out["allreduce/mlp/fp16"], out["ddp/mlp"], atol=2e-3)
        # They went through the group's shared memory, not gloo's 16-bit all_reduce.
        assert out["transport"] == "shm"
        assert out["allreduce/mlp/bf16/backend16"] == out["allreduce/mlp/fp16/backend16"] == 0
        # and the LR change / schedule: allreduce equals the single process too
        _same(out["allreduce/mlp"], single_process("mlp", "sgd", 2), atol=1e-5)
    torch.testing.assert_close(
        results[0].value["sharded/mlp"][0], results[1].value["sharded/mlp"][0]
    )
    _check_ps_optimizer_state(results[0].value)


def _check_ps_optimizer_state(out: dict[str, Any]) -> None:
    """The ps-sync job's optimizer state dict is the single-process Adam's."""
    state, changed, read_back = from_bytes(out["ps-sync/state"])
    ref, ref_opt = single_process_run("mlp", "adam", 2)
    want = ref_opt.state_dict()
    assert sorted(state["state"]) == sorted(want["state"])
    for i, entry in want["state"].items():
        for key, value in entry.items():
            # Moments summed on the servers from two halves: float32 rounding only.
            torch.testing.assert_close(state["state"][i][key], value, rtol=0, atol=1e-5)
    assert [g["lr"] for g in state["param_groups"]] == [g["lr"] for g in want["param_groups"]]
    # load_state_dict sent another state to the servers: it is what they now hold.
    for i, entry in changed["state"].items():
        for key, value in entry.items():
            assert torch.equal(read_back["state"][i][key], value), (i, key)
    assert read_back["param_groups"] == changed["param_groups"]
    # A plain single-process Adam takes it and trains on equal to the reference.
    plain = mlp()
    with torch.no_grad():
        for p, value in zip(plain.parameters(), out["ps-sync/mlp"], strict=True):
            p.copy_(torch.from_numpy(value))
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.01)
    plain_opt.load_state_dict(state)
    plain_steps(plain, plain_opt, 0, 1, range(5, 7))
    plain_steps(ref, ref_opt, 0, 1, range(5, 7))
    _same(params(plain), params(ref), atol=1e-5)


def test_sharded_state_dict_loads_into_a_plain_optimizer_and_a_3_rank_job(
    tmp_path: Path,
) -> None:
    checkpoints = str(tmp_path / "fit")
    saved = run_ranks(sharded_save, 2, checkpoints, timeout=120)
    weights, state = from_bytes(saved[0].value)
    # Every rank assembled the same full state dict.
    other = from_bytes(saved[1].value)[1]
    for i, entry in state["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, other["state"][i][key]), (i, key)
    # The reference: 5 single-process steps.
    ref = mlp()
    ref_opt = two_groups(ref)
    plain_steps(ref, ref_opt, 0, 1, range(5))
    want = [p.detach().numpy() for p in ref.parameters()]
    # A plain single-process optimizer takes the dict as its own.
    plain = mlp()
    plain.load_state_dict(weights)
    plain_opt = two_groups(plain)
    plain_opt.load_state_dict(state)
    plain_steps(plain, plain_opt, 0, 1, range(3, 5))
    # Slices and sums are float32 rounding apart from the single process.
    _same([p.detach().numpy() for p in plain.parameters()], want, atol=1e-5)
    # And a 3-rank job continues from it; its fit resumes the 2-rank fit's checkpoint.
    with gradhub.init(timeout=10) as runtime:
        fit_want = fit_sharded(runtime, None, epochs=2)[1]  # one process, both epochs
    for r in run_ranks(sharded_resume, 3, saved[0].value, checkpoints, timeout=150):
        own, (start, fitted) = r.value
        _same(own, want, atol=1e-5)
        assert start == 3  # the end of epoch 1, written by 2 ranks
        # Adam's moments and the schedule came through the checkpoint: float32 rounding only.
        _same(fitted, fit_want, atol=1e-5)


@pytest.fixture(scope="module")
def misuse_and_uneven_results() -> Iterator[list[Any]]:
    with (
        start_server(ServerConfig(mode="sync", workers=2)) as server,
        start_server(ServerConfig(mode="async", workers=2)) as async_server,
        start_server(ServerConfig(mode="ssp", workers=2), in_thread=True) as ssp_server,
    ):
        servers = {
            "ps-sync": server.address,
            "ps-async": async_server.address,
            "ps-ssp": ssp_server.address,
        }
        yield run_ranks(misuse_and_uneven, 2, servers, timeout=180)


def test_each_misuse_is_an_error_with_its_message(misuse_and_uneven_results: list[Any]) -> None:
    for r in misuse_and_uneven_results:
        misuse = r.value["misuse"]
        assert sorted(misuse) == sorted(["allreduce", "sharded", "ps-sync", "ps-async", "ps-ssp"])
        for strategy, seen in misuse.items():
            assert "handed to gradhub.prepare" in seen["original"], strategy
            if strategy == "allreduce":
                assert seen["second backward"] == "allowed"
            assert "without a backward() outside no_sync()" in seen["no sync"], strategy
            if strategy.startswith("ps-"):
                # The servers hold the parameters: check_in_sync pulls them first,
                # so a local change is replaced, not reported (see strategies/ps.py).
                assert "diverged" not in seen and "in sync after a local change" in seen
            else:
                assert "rank(s) 1 differ from rank 0" in seen["diverged"]


def test_the_prepared_model_is_the_original_with_its_keys(
    misuse_and_uneven_results: list[Any],
) -> None:
    for strategy, seen in misuse_and_uneven_results[0].value["misuse"].items():
        assert seen["module is the original"] is True, strategy
        keys, original = seen["keys"]
        assert keys == original == ["0.weight", "0.bias", "2.weight", "2.bias"], strategy


def test_clip_under_ps_async_is_per_worker(misuse_and_uneven_results: list[Any]) -> None:
    seen = [r.value["clip ps-async"] for r in misuse_and_uneven_results]
    for s in seen:
        # The norm returned is the worker's own gradient's, and its own is clipped.
        assert s["norm"] == pytest.approx(s["own"], rel=1e-6)
        assert s["own"] > 0.05 and s["after"] == pytest.approx(0.05, rel=1e-4)
    assert seen[0]["norm"] != pytest.approx(seen[1]["norm"], rel=1e-3)  # not one global norm


def test_clip_takes_the_compiled_prepared_model(misuse_and_uneven_results: list[Any]) -> None:
    seen = [r.value["clip compiled"] for r in misuse_and_uneven_results]
    for s in seen:
        # allreduce: .grad holds the combined gradient, the same bits on every rank.
        assert s["norm"] == seen[0]["norm"]
        assert s["norm"] == pytest.approx(s["combined"], rel=1e-6)
        assert s["combined"] > 0.05 and s["after"] == pytest.approx(0.05, rel=1e-4)


@pytest.mark.parametrize("given", ["module", "compiled module", "str"])
def test_clip_of_an_unprepared_model_says_what_to_pass(given: str) -> None:
    model: Any = "model" if given == "str" else torch.nn.Linear(2, 2)
    model = compiled(model) if given == "compiled module" else model
    with pytest.raises(NotPreparedError) as err:
        gradhub.clip_grad_norm_(model, 1.0)
    assert isinstance(err.value, TypeError)
    text = str(err.value)
    assert "takes the model gradhub.prepare returned (or torch.compile of it)" in text
    assert "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)" in text


def test_set_samples_weights_uneven_batches_exactly(misuse_and_uneven_results: list[Any]) -> None:
    want = uneven_reference()
    for r in misuse_and_uneven_results:
        for got in r.value["uneven"].values():
            # (5 * mean5 + 3 * mean3) / 8 vs mean8: reordered float32 sums only.
            _same(got, want, atol=1e-6)


class _MySGD(torch.optim.SGD):
    """A custom optimizer class: servers cannot rebuild it by name."""


def _lr_change_run(strategy: str, servers: list[str]) -> list[np.ndarray]:
    base = mlp()
    model, opt = gradhub.prepare(
        base,
        torch.optim.SGD(base.parameters(), lr=0.2, momentum=0.9),
        strategy=strategy,
        servers=servers,
        timeout=20,
    )
    with model:
        train(model, opt, "mlp", 0, 1, no_sync=model.no_sync)
        model.strategy.refresh()
        return params(model.module)


def test_ps_async_and_ssp_take_lr_changes_and_refuse_foreign_optimizers() -> None:
    ref = mlp()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9)
    train(ref, ref_opt, "mlp", 0, 1, single=True)
    want = params(ref)
    with gradhub.init(timeout=20):
        for mode in ("async", "ssp"):
            with start_server(ServerConfig(mode=mode, workers=1)) as server:
                # One worker: every push is applied before its pull, as one process
                # steps; the schedule and the change by hand reached the servers.
                _same(_lr_change_run(f"ps-{mode}", [server.address]), want, atol=1e-6)
        fixed = ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.5)
        with start_server(fixed) as server:
            base = mlp()
            with pytest.raises(OptimizerMismatchError, match=r"(?s)Adam.*SGD|SGD.*Adam"):
                gradhub.prepare(
                    base,
                    torch.optim.Adam(base.parameters()),
                    strategy="ps-async",
                    servers=[server.address],
                    timeout=20,
                )
            with pytest.raises(TypeError, match=r"not a torch\.optim optimizer"):
                gradhub.prepare(
                    base,
                    _MySGD(base.parameters(), lr=0.1),
                    strategy="ps-async",
                    servers=[server.address],
                    timeout=20,
                )
