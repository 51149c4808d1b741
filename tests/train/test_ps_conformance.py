"""``ps-*`` under unchanged DDP lines: real ranks and servers against a
single-process run on the combined batch; the translated errors."""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

import gradhub
from gradhub.errors import CollectiveTimeoutError, LaunchEnvironmentError, RendezvousError
from gradhub.optim import OptimizerSpec
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.launch import start_server
from gradhub.ps.server.store import ParameterStore
from gradhub.train.strategies.ps import ADDRESSES_KEY, published_addresses
from harness import run_ranks
from ps_conformance_jobs import Case, adamw, broadcast_timeout_job, ps_sync_job, reference

# float32 sums in another order (the all-reduce, the single process's batch of 6)
# differ in the last bits; AdamW's normalised step keeps them at that scale.
ATOL = 1e-6


def _close(got: dict[str, Any], want: dict[str, Any], atol: float = ATOL) -> None:
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=atol, err_msg=name)


@pytest.fixture(scope="module")
def sync_results(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    saved = tmp_path_factory.mktemp("ps") / "checkpoint.pt"
    with start_server(ServerConfig(mode="sync", workers=2)) as server:  # the script's optimizer
        results = run_ranks(ps_sync_job, 2, server.address, str(saved), timeout=120)
    return [r.value for r in results]


@pytest.fixture(scope="module")
def ref() -> dict[str, Any]:
    return reference("conf")


@pytest.mark.slow
def test_ps_sync_grad_holds_the_combined_gradient_on_every_rank(
    sync_results: list[Any], ref: dict[str, Any]
) -> None:
    zero, one = (r["grads"] for r in sync_results)
    for name, want in ref["grads"].items():
        if want is None:  # `never`: no rank used it, so no gradient anywhere (DDP)
            assert zero[name] is None and one[name] is None, name
            continue
        assert np.array_equal(zero[name], one[name]), name  # the same bits on every rank
        # Loss-scaled by 1024: the same sums, 1024 times larger.
        np.testing.assert_allclose(zero[name], want, rtol=0, atol=1024 * ATOL, err_msg=name)


@pytest.mark.slow
def test_ps_sync_torch_clip_scaler_and_hyperparameters_give_the_single_process_result(
    sync_results: list[Any], ref: dict[str, Any]
) -> None:
    # torch's clip and GradScaler (a skipped step), a scheduler, betas and
    # weight decay changed mid-run, amsgrad: all reach the servers.
    for r in sync_results:
        _close(r["after4"], ref["after4"])
    setup = [r["setup"] for r in sync_results]
    for name in setup[0]:  # rank 0's values everywhere, frozen parameter and buffer too
        assert np.array_equal(setup[0][name], setup[1][name]), name
    start = Case("conf").state_dict()
    for r in sync_results:  # rank 0's buffer, broadcast at the forward (broadcast_buffers)
        assert np.array_equal(r["buffer"], start["conf.shift"].numpy())
    for r in sync_results:  # the unused layer is not moved by AdamW's decay
        for name in ("conf.never.weight", "conf.never.bias"):
            assert np.array_equal(r["after4"][name], start[name].numpy()), name


@pytest.mark.slow
def test_ps_checkpoints_load_with_plain_torch_and_resume(
    sync_results: list[Any], ref: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    for r in sync_results:
        # rank 0's files, resumed under allreduce
        _close(r["other_strategy"], ref["after6"])  # rank 0's files, resumed under allreduce
    plain_ref = reference("resume")["plain4"]
    for r in sync_results:
        _close(r["resume"], plain_ref)  # loaded into the plain objects before prepare
        # loaded after prepare (the next pull keeps it); two synchronising backwards a step
        _close(r["reload"], plain_ref)


def test_published_addresses_names_a_store_that_does_not_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: nobody answers
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(RendezvousError, match=rf"store at 127.0.0.1:{port} did not answer"):
            published_addresses(timeout=0.2)


def test_published_addresses_reads_the_store_or_names_a_bad_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=5))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    assert published_addresses(timeout=0.2) is None  # answers, holds none
    store.set(ADDRESSES_KEY, json.dumps(["tcp://10.0.0.5:5555"]))
    assert published_addresses(timeout=1) == ["tcp://10.0.0.5:5555"]
    store.set(ADDRESSES_KEY, "{not json")
    with pytest.raises(LaunchEnvironmentError, match="could not be read as a JSON list"):
        published_addresses(timeout=1)


@pytest.mark.slow
def test_rank0_failures_and_a_bounded_broadcast_name_the_rank() -> None:
    zero, one = (r.value for r in run_ranks(broadcast_timeout_job, 2, timeout=60))
    assert zero[0] == "ValueError: the servers refused the key"  # rank 0: its own error
    assert one[0].startswith(
        "GradhubError: rank 0 could not initialise the parameters on the servers (ps-sync)"
    )
    message = zero[1]
    assert message.startswith(CollectiveTimeoutError.__name__), message
    assert "waiting for rank(s) 1" in message and "aligning the workers' steps" in message


def test_every_hyperparameter_type_survives_the_wire() -> None:
    """Tuples (nested, with None), bools and None, at init and with a push."""
    spec = OptimizerSpec.of(torch.optim.Adafactor, lr=0.01, eps=(None, 1e-3), foreach=None)
    assert OptimizerSpec.from_dict(spec.to_dict()) == spec
    store = ParameterStore(optimizer=None)
    store.init("w", torch.zeros(2, 3), optimizer=OptimizerSpec.of(torch.optim.Adam, lr=0.1))
    store.set_hyperparameters("w", {"betas": [0.5, 0.9], "amsgrad": True, "foreach": None})
    group = store.optimizer("w").param_groups[0]  # type: ignore[union-attr]
    assert group["betas"] == (0.5, 0.9) and group["amsgrad"] is True and group["foreach"] is None


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_ps_async_and_ssp_leave_a_parameter_the_worker_did_not_use_alone(mode: str) -> None:
    """One worker: a push moves what its backward reached and nothing else (ssp:
    a skip push), and a betas change reaches the servers (the single-process
    AdamW, 3 steps)."""
    model, plain = Case("alone"), Case("alone")
    ref_opt = adamw(plain)
    with (
        start_server(ServerConfig(mode=mode, workers=1), in_thread=True) as server,
        gradhub.init(timeout=10) as runtime,
    ):
        prepared, opt = gradhub.prepare(
            model,
            adamw(model),
            strategy=f"ps-{mode}",
            runtime=runtime,
            servers=[server.address],
            timeout=10,
        )
        with prepared:
            for step in range(3):
                for group in (*opt.param_groups, *ref_opt.param_groups):
                    group["betas"] = (0.9 - 0.1 * step, 0.99)
                for m, o in ((prepared, opt), (plain, ref_opt)):
                    o.zero_grad()
                    x, y = torch.ones(2, 6) * step, torch.tensor([0, 1])
                    torch.nn.functional.cross_entropy(m(x), y).backward()
                    o.step()
    for (name, got), want in zip(
        model.state_dict().items(), plain.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=name)
    assert torch.equal(model.alone.never.weight, Case("alone").alone.never.weight)
