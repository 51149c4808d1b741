"""The DDP surface of ``gradhub.prepare`` under ``allreduce``: 2 real ranks, each
check against DDP in the same processes, bit for bit unless a tolerance is given."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import gradhub
from ddp_surface_jobs import ddp_checks, runs_out_without_join
from gradhub.errors import MisuseError, UnsupportedOptionError
from gradhub.train.ddp_options import split_ddp_options
from gradhub.train.strategies.sharded import ShardedStrategy
from harness import run_ranks

BIT_FOR_BIT = [
    "nanogpt",
    "repeated sync",
    "forward decides",
    "gradient_as_bucket_view",
    "clip torch",
    "clip gradhub",
    "buffers",
    "buffers off",
    "several optimizers",
    "scaler",
    "bucket_cap_mb",
    "clip gradhub, buckets",
    "allreduce_hook",
    "fp16_compress_hook",
    "bf16_compress_hook",
    "user hook",
    "join divide=True",
    "join divide=False",
]


@pytest.fixture(scope="module")
def checks() -> list[Any]:
    return [r.value for r in run_ranks(ddp_checks, 2, timeout=240)]


@pytest.mark.slow
@pytest.mark.parametrize("name", BIT_FOR_BIT)
def test_equals_ddp_bit_for_bit(checks: list[Any], name: str) -> None:
    for rank, seen in enumerate(checks):
        assert seen[name] == 0.0, (rank, name, seen[name])


@pytest.mark.slow
def test_unused_everywhere_keeps_grad_none_and_is_not_moved(checks: list[Any]) -> None:
    for seen in checks:
        assert isinstance(seen["unused"], dict), seen["unused"]
        assert seen["unused"]["diff"] == 0.0
        assert seen["unused"]["never grad"] == [None, None]
        assert seen["unused"]["never moved"]


@pytest.mark.slow
def test_torch_powersgd_hook_runs_and_replicas_agree(checks: list[Any]) -> None:
    for seen in checks:
        assert seen["powerSGD_hook"] is True, seen["powerSGD_hook"]


@pytest.mark.slow
def test_join_can_throw_on_every_rank_naming_who_ran_out(checks: list[Any]) -> None:
    for seen in checks:
        assert seen["join throw"].startswith("rank(s) 1 ran out of inputs"), seen["join throw"]


@pytest.mark.slow
def test_bf16_parameters_sum_in_fp32_rounded_once(checks: list[Any]) -> None:
    for seen in checks:
        assert seen["bf16"] == 0.0


@pytest.mark.slow
def test_rank0_alone_checkpoints_without_waiting(checks: list[Any]) -> None:
    seen = checks[0]["rank 0 alone"]
    assert isinstance(seen, dict), seen
    assert seen["loads"] and seen["seconds"] < 2.5  # rank 1 sleeps 3 s meanwhile
    for s in checks:
        assert s["rank 0 alone"]["zero_grad"] == (True, True)


@pytest.mark.slow
def test_a_rank_that_runs_out_without_join_is_named() -> None:
    seen = [r.value for r in run_ranks(runs_out_without_join, 2, timeout=60)]
    assert seen[1] == "finished"
    assert "rank(s) 1" in seen[0] and seen[0].startswith(
        ("CollectiveTimeoutError", "WorkerFailedError")
    ), seen[0]


def test_ddp_keywords_are_taken_or_refused_saying_why() -> None:
    cpu = torch.device("cpu")
    ddp, rest = split_ddp_options(
        "allreduce",
        {"find_unused_parameters": True, "static_graph": True, "bucket_cap_mb": 5, "x": 1},
        cpu,
    )
    assert rest == {"bucket_mb": 5.0, "x": 1}
    ddp, rest = split_ddp_options("sharded", {"broadcast_buffers": False}, cpu)
    assert not ddp.sync_buffers_at_forward and not ddp.sync_buffers_at_setup
    ddp, _ = split_ddp_options("sharded", {"forward_sync_buffers": False}, cpu)
    assert not ddp.sync_buffers_at_forward and ddp.sync_buffers_at_setup
    split_ddp_options("allreduce", {"device_ids": None, "output_device": None, "dim": 0}, cpu)
    refused = [
        ("ps-sync", {"bucket_cap_mb": 5}, "no gradient buckets"),
        ("allreduce", {"device_ids": [1]}, "the model is on cpu"),
        ("allreduce", {"process_group": object()}, "default group"),
        ("allreduce", {"mixed_precision": object()}, "autocast"),
        ("allreduce", {"init_sync": False}, "rank 0"),
        ("allreduce", {"bucket_cap_mb": 5, "bucket_mb": 5}, "not both"),
        (None, {"bucket_cap_mb": 5}, "constructor"),
    ]
    for strategy, options, why in refused:
        with pytest.raises(UnsupportedOptionError, match=why) as info:
            split_ddp_options(strategy, options, cpu)
        assert isinstance(info.value, TypeError) and "- help:" in str(info.value)


def test_comm_hooks_and_join_elsewhere_say_what_to_use() -> None:
    strategy = ShardedStrategy()
    with pytest.raises(MisuseError, match="compress="):
        strategy.register_comm_hook(None, lambda state, bucket: None)
    with pytest.raises(MisuseError, match="strategy='allreduce'"):
        strategy.join()
    assert isinstance(gradhub.errors.UnsupportedOptionError("x"), gradhub.GradhubError)
