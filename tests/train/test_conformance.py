"""DDP conformance: every unchanged DDP line does what it does under DDP, or is refused
with a typed error that says what to write instead, under every strategy.

Each strategy runs one 2-rank job (``conformance_jobs.conformance_job``) that
performs every check in sequence; the tests below assert one behaviour each,
parametrised by strategy, so a failure names both. References and tolerances:

- ``allreduce``: DDP over gloo in the same processes, bit for bit.
- ``sharded``: DDP, ``SHARDED_ATOL``: the ring sums each slice in another
  order than gloo's all-reduce, and the norm is summed from slices: float32
  rounding, a few ulps per step.
- ``ps-sync``: DDP, ``PS_ATOL``: the servers add the pushed shares
  ``g0 / 2 + g1 / 2`` where DDP halves ``g0 + g1``, and run the optimizer in
  their own process: float32 rounding.
- ``ps-async``/``ps-ssp``: rank 0 steps alone (its pushes are applied on
  their own) against one process on its batches with each gradient scaled by
  its share ``1 / 2``: the per-worker meaning; ``PS_ATOL`` for the same reason.
- ``diloco``: every check stays between two syncs (``inner_steps`` is 100),
  where each worker's loop is one process's: every rank against one process
  on its own batches, bit for bit. The sync itself: ``test_diloco.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from conformance_checks_state import from_bytes
from conformance_jobs import ALL, SYNC, TIMEOUT, conformance_job, mlp
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.launch import start_server
from harness import RankResult, run_ranks

pytestmark = pytest.mark.slow

SHARDED_ATOL = 1e-5
PS_ATOL = 1e-5
ASYNC = ("ps-async", "ps-ssp")

Outcome = list[RankResult]


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, str]]:
    with (
        start_server(ServerConfig(mode="sync", workers=2), in_thread=True) as s,
        start_server(ServerConfig(mode="async", workers=2), in_thread=True) as a,
        # Rank 0 steps alone in the per-worker checks: no staleness wait for rank 1.
        start_server(ServerConfig(mode="ssp", workers=2, max_staleness=1000), in_thread=True) as p,
    ):
        yield {"ps-sync": s.address, "ps-async": a.address, "ps-ssp": p.address}


@pytest.fixture(scope="module")
def conformance(servers: dict[str, str]) -> Callable[[str], Outcome]:
    """One job per strategy, run on first use and kept for the module."""
    done: dict[str, Outcome] = {}

    def outcome(strategy: str) -> Outcome:
        if strategy not in done:
            done[strategy] = run_ranks(
                conformance_job, 2, strategy, servers, timeout=40 * TIMEOUT, check=False
            )
        return done[strategy]

    return outcome


def values(outcome: Outcome, name: str) -> list[Any]:
    """Each rank's value of check ``name``; fails the test with the first traceback."""
    out = []
    for r in outcome:
        if r.value is None:
            pytest.fail(f"rank {r.rank}: the job failed\n{r.error}")
        got = r.value.get(name)
        if got is None:
            pytest.fail(f"rank {r.rank}: check {name!r} did not run\n{r.error or ''}")
        if "error" in got:
            pytest.fail(f"rank {r.rank}: check {name!r} raised\n{got['error']}")
        out.append(got["value"])
    return out


def atol(strategy: str) -> float:
    return {"allreduce": 0.0, "sharded": SHARDED_ATOL, "diloco": 0.0}.get(strategy, PS_ATOL)


def same(got: list[np.ndarray], want: list[np.ndarray], tol: float, what: str = "") -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if tol == 0:
            assert np.array_equal(g, w), f"{what} tensor {i}: max diff {np.abs(g - w).max():.3g}"
        else:
            np.testing.assert_allclose(g, w, rtol=0, atol=tol, err_msg=f"{what} tensor {i}")


def matches_reference(outcome: Outcome, name: str, strategy: str, tol: float | None = None) -> None:
    """Every rank that stepped ends with its reference's parameters."""
    tol = atol(strategy) if tol is None else tol
    stepped = [v for v in values(outcome, name) if "gradhub" in v]
    assert stepped, "no rank stepped"
    for v in stepped:
        same(v["gradhub"], v["reference"], tol, name)


# 1. gradient accumulation -------------------------------------------------------------


@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("how", ["attr", "no_sync", "every"])
def test_gradient_accumulation(conformance: Any, strategy: str, how: str) -> None:
    """``require_backward_grad_sync`` (nanoGPT), ``no_sync()``, and a synchronising
    backward after another (DDP combines again what ``.grad`` holds)."""
    matches_reference(conformance(strategy), f"accumulation_{how}", strategy)


# 2. torch's clip and GradScaler; 10. allreduce bit for bit -------------------------------


@pytest.mark.parametrize("strategy", ALL)
def test_torch_clip_grad_norm(conformance: Any, strategy: str) -> None:
    """torch.nn.utils.clip_grad_norm_(model.parameters(), c): DDP's norm and result
    (the global norm); per worker under ps-async/ps-ssp."""
    outcome = conformance(strategy)
    matches_reference(outcome, "clip_torch", strategy)
    for v in values(outcome, "clip_torch"):
        if "seen" in v:
            np.testing.assert_allclose(
                v["seen"]["norms"], v["ref_seen"]["norms"], rtol=0, atol=atol(strategy)
            )


@pytest.mark.parametrize("strategy", ALL)
def test_gradhub_clip_grad_norm(conformance: Any, strategy: str) -> None:
    """gradhub.clip_grad_norm_ against DDP with torch's clip (allreduce: bit for bit)."""
    outcome = conformance(strategy)
    matches_reference(outcome, "clip_gradhub", strategy)


@pytest.mark.parametrize("strategy", ALL)
def test_torch_grad_scaler(conformance: Any, strategy: str) -> None:
    """scale / unscale_ / clip / step / update, one step skipped for an inf: DDP's
    parameters and DDP's scale after every step."""
    outcome = conformance(strategy)
    matches_reference(outcome, "grad_scaler", strategy)
    for v in values(outcome, "grad_scaler"):
        if "seen" in v:
            assert v["seen"]["scales"] == v["ref_seen"]["scales"]


# 3. unused parameters ------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ALL)
def test_unused_parameters(conformance: Any, strategy: str) -> None:
    """A parameter no rank used: untouched by AdamW's decay; one used by rank 0 only:
    DDP(find_unused_parameters=True)'s merge."""
    outcome = conformance(strategy)
    for v in values(outcome, "unused_parameters"):
        if "gradhub" in v:
            assert v["never_moved"] == 0.0
    matches_reference(outcome, "unused_parameters", strategy)


@pytest.mark.parametrize("strategy", ALL)
def test_unused_parameter_grad_stays_none(conformance: Any, strategy: str) -> None:
    for v in values(conformance(strategy), "unused_grad_is_none"):
        assert v == {"after backward": True, "after step": True}


# 4. rank 0's values, buffers -----------------------------------------------------------------


@pytest.mark.parametrize("strategy", ALL)
def test_rank0_parameters_and_buffers_at_setup(conformance: Any, strategy: str) -> None:
    """Ranks seeded differently: every rank holds rank 0's parameters, frozen ones
    and buffers included, after prepare."""
    got = values(conformance(strategy), "rank0_values_at_setup")
    for v in got:
        same(v["after"], got[0]["before"], 0.0, "rank 0's initial values")


@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast_buffers", "buffers_off"])
def test_buffers_follow_ddp(conformance: Any, strategy: str, broadcast: bool) -> None:
    """Batch-norm statistics: rank 0's at every forward (DDP's default), or each
    rank's own with broadcast_buffers=False; the same bits as DDP on each rank."""
    if strategy == "diloco" and broadcast:
        pytest.skip(
            "diloco: no forward communicates; buffers follow rank 0 at each sync "
            "(test_diloco.py), not at each forward"
        )
    name = "broadcast_buffers" if broadcast else "broadcast_buffers_off"
    got = values(conformance(strategy), name)
    for v in got:
        same(v["buffers"], v["ref_buffers"], 0.0, "buffers")
    if strategy in SYNC:
        matches_reference(conformance(strategy), name, strategy)


# 5. checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ALL)
def test_optimizer_state_loaded_before_prepare(conformance: Any, strategy: str) -> None:
    matches_reference(conformance(strategy), "checkpoint_before_prepare", strategy)


@pytest.mark.parametrize("strategy", ALL)
def test_state_loaded_after_prepare(conformance: Any, strategy: str) -> None:
    matches_reference(conformance(strategy), "checkpoint_after_prepare", strategy)


@pytest.mark.parametrize("strategy", ALL)
def test_checkpoint_written_by_ddp(conformance: Any, strategy: str) -> None:
    """``model.load_state_dict`` of a DDP run's checkpoint (``module.`` keys) after
    prepare: DDP's values, or a typed error that says what to write instead."""
    for v in values(conformance(strategy), "checkpoint_from_ddp"):
        if "refused" in v:
            assert v["refused"]["typed"] and v["refused"]["help"], v["refused"]
        else:
            same(v["gradhub"], v["reference"], 0.0, "loaded values")


@pytest.mark.parametrize("strategy", ALL)
def test_rank0_only_checkpoint(conformance: Any, strategy: str) -> None:
    """state_dict() on rank 0 alone returns without the other rank; the file loads
    into a plain model and AdamW and holds DDP's values."""
    rank0 = values(conformance(strategy), "checkpoint_rank0_only")[0]
    assert rank0["seconds"] < TIMEOUT / 3, "rank 0's state_dict() waited for the other rank"
    saved = from_bytes(rank0["file"])
    weights = saved["model"]
    if rank0["tag"] is not None:  # the suite's prefix for the servers' keys
        weights = {k.removeprefix(f"{rank0['tag']}."): v for k, v in weights.items()}
    from conformance_checks import adamw_groups

    model = mlp()
    model.load_state_dict(weights)  # strict: the plain model's keys
    opt = adamw_groups(model)
    opt.load_state_dict(saved["optimizer"])
    ref = from_bytes(rank0["reference"])
    tol = atol(strategy)
    for key, value in ref["model"].items():
        np.testing.assert_allclose(weights[key].numpy(), value.numpy(), rtol=0, atol=tol)
    for index, entry in ref["optimizer"]["state"].items():
        for key, value in entry.items():
            np.testing.assert_allclose(
                np.asarray(opt.state_dict()["state"][index][key]),
                np.asarray(value),
                rtol=0,
                atol=tol,
                err_msg=f"optimizer state {index} {key}",
            )
    x = torch.randn(4, 6)
    model(x).sum().backward()
    opt.step()  # a plain step runs on it


# 6. hyperparameters ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ALL)
def test_hyperparameters_of_every_type(conformance: Any, strategy: str) -> None:
    """Adam with tuple/bool settings, betas and eps changed mid-run."""
    matches_reference(conformance(strategy), "hyperparameters", strategy)


# 7. join --------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ALL)
def test_join_uneven_inputs(conformance: Any, strategy: str) -> None:
    """``with model.join():`` with 3 batches on rank 0 and 2 on rank 1: DDP's result,
    or a typed error naming rank 1 (the one that ran out), or ``join()`` itself
    refused at its line with a typed error that says what to write instead
    (allreduce must run it)."""
    for v in values(conformance(strategy), "join"):
        if "refused_at_join" in v:
            refused = v["refused_at_join"]
            assert strategy != "allreduce", refused["message"]
            assert refused["typed"] and refused["help"], refused
        elif "refused" in v:
            assert v["refused"]["typed"] and "rank 1" in v["refused"]["message"], v["refused"]
        elif "reference" in v:
            same(v["gradhub"], v["reference"], atol(strategy), "join")


# 8. DDP's keyword arguments, register_comm_hook ----------------------------------------------


@pytest.mark.parametrize("strategy", ALL)
def test_ddp_keyword_arguments(conformance: Any, strategy: str) -> None:
    for v in values(conformance(strategy), "ddp_keyword_arguments"):
        for name, seen in v.items():
            if seen != "accepted":
                assert seen["typed"] and seen["help"], (name, seen)


@pytest.mark.parametrize("strategy", ALL)
def test_register_comm_hook(conformance: Any, strategy: str) -> None:
    """DDP's fp16_compress_hook run by the prepared model: DDP's result bit for bit
    (the hook is elementwise on each bucket, so the bucket layout does not
    matter), or a typed error that points at compress=."""
    outcome = conformance(strategy)
    got = values(outcome, "register_comm_hook")
    if any("refused" in v for v in got):
        for v in got:
            refused = v["refused"]
            assert refused["typed"] and "compress" in refused["message"], refused
        assert strategy != "allreduce", "allreduce must run DDP's comm hooks"
    else:
        matches_reference(outcome, "register_comm_hook", strategy, tol=0.0)


# 9. optimizers, bf16 --------------------------------------------------------------------------


def _works_or_refused(
    outcome: Outcome, name: str, strategy: str, must_work: bool, refusal_names: str = ""
) -> None:
    got = values(outcome, name)
    refused = [v["refused"] for v in got if "refused" in v]
    if refused:
        assert not must_work, f"{strategy} must run it: {refused[0]['message']}"
        for r in refused:
            assert r["typed"] and r["help"] and refusal_names in r["message"], r
    else:
        matches_reference(outcome, name, strategy)


@pytest.mark.parametrize("strategy", ALL)
def test_custom_optimizer(conformance: Any, strategy: str) -> None:
    """A script's own torch.optim.Optimizer subclass: allreduce runs it (DDP's result);
    elsewhere it runs or is refused with a typed error."""
    _works_or_refused(conformance(strategy), "custom_optimizer", strategy, strategy == "allreduce")


@pytest.mark.parametrize("strategy", ALL)
def test_several_optimizers(conformance: Any, strategy: str) -> None:
    outcome = conformance(strategy)
    _works_or_refused(outcome, "several_optimizers", strategy, strategy == "allreduce")


@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("optimizer", ["adafactor", "muon"])
def test_non_elementwise_optimizer(conformance: Any, strategy: str, optimizer: str) -> None:
    """Adafactor and Muon update whole matrices: DDP's result, or (sharded) a refusal
    naming allreduce."""
    names = "allreduce" if strategy == "sharded" else ""
    _works_or_refused(conformance(strategy), optimizer, strategy, strategy == "allreduce", names)


@pytest.mark.parametrize("strategy", ALL)
def test_bf16_parameters(conformance: Any, strategy: str) -> None:
    """bf16 parameters: DDP's result (bf16 rounding of the update: 8 significant
    bits) or a typed error."""
    outcome = conformance(strategy)
    got = values(outcome, "bf16_parameters")
    if any("refused" in v for v in got):
        for v in got:
            assert v["refused"]["typed"] and v["refused"]["help"], v["refused"]
    else:
        matches_reference(
            outcome, "bf16_parameters", strategy, tol=0 if strategy == "allreduce" else 2e-2
        )
