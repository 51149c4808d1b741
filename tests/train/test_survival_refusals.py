"""What a surviving job (``gradhub run --survive``) refuses, at the line that asks
for it, before anything is sent: the strategies that do not survive, and the DDP
features whose meaning a membership change would break. In one process: a
runtime of one rank marked as surviving is enough to reach every check."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

import gradhub
from gradhub.errors import LaunchEnvironmentError, MisuseError, UnsupportedByStrategyError
from gradhub.train.strategies.allreduce import AllReduceStrategy


@pytest.fixture
def surviving() -> Iterator[gradhub.Runtime]:
    with gradhub.init() as runtime:
        yield dataclasses.replace(runtime, survive=True)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


class _Stays(AllReduceStrategy):
    """A strategy that does not say it survives (every built-in one does)."""

    name = "stays"
    survives = False


def test_strategies_that_do_not_survive_refuse_at_prepare(surviving: gradhub.Runtime) -> None:
    with pytest.raises(UnsupportedByStrategyError, match="does not survive"):
        gradhub.prepare(*_model(), strategy=_Stays(), runtime=surviving)


def test_allreduce_refuses_compression_a_comm_hook_and_join(surviving: gradhub.Runtime) -> None:
    with pytest.raises(UnsupportedByStrategyError, match="compress='powersgd' under"):
        gradhub.prepare(*_model(), compress="powersgd", runtime=surviving)
    model, _ = gradhub.prepare(*_model(), runtime=surviving)
    with pytest.raises(UnsupportedByStrategyError, match="register_comm_hook under"):
        model.register_comm_hook(None, lambda state, bucket: bucket)
    with pytest.raises(MisuseError, match="join\\(\\) in a surviving job"):
        model.join()


def test_sharded_refuses_a_wire_codec_and_16_bit_parameters(surviving: gradhub.Runtime) -> None:
    """Its mirrors keep fp32 masters that are the parameters themselves."""
    with pytest.raises(UnsupportedByStrategyError, match="compress='bf16'"):
        gradhub.prepare(*_model(), strategy="sharded", compress="bf16", runtime=surviving)
    model, _ = _model()
    model.bfloat16()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(UnsupportedByStrategyError, match=r"torch\.bfloat16"):
        gradhub.prepare(model, optimizer, strategy="sharded", runtime=surviving)


def test_survive_true_outside_the_surviving_launcher_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GRADHUB_SURVIVE", raising=False)
    with pytest.raises(LaunchEnvironmentError, match="gradhub run -n N --survive"):
        gradhub.init(survive=True)


def test_global_batch_sampler_gives_fits_batches_without_a_job() -> None:
    """No runtime: the one-process shares are fit's global batches, in fit's order."""
    from gradhub.train.data import Source

    data = torch.arange(50)
    sampler = gradhub.GlobalBatchSampler(range(50), 16, seed=3)
    sampler.set_epoch(2)
    source = Source((data, data), what="train_data", batch_size=16, seed=3, shuffle=True)
    want = [c.tolist() for c in source.global_batches(2)]
    assert list(sampler) == want and len(sampler) == 4
    with pytest.raises(gradhub.errors.InvalidOptionError, match="global_batch_size"):
        gradhub.GlobalBatchSampler(range(5), 0)
