"""What ``strategy="diloco"`` refuses in a surviving job (``gradhub run --survive``),
at ``prepare``, before anything is sent; and that the rest is accepted. In one
process: a runtime of one rank marked as surviving reaches every check (the
jobs themselves: ``tests/jobs/test_survive_diloco.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

import gradhub
from gradhub.errors import UnsupportedByStrategyError


@pytest.fixture
def surviving() -> Iterator[gradhub.Runtime]:
    with gradhub.init() as runtime:
        yield dataclasses.replace(runtime, survive=True)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_diloco_survives_with_fragments_and_a_codec(surviving: gradhub.Runtime) -> None:
    """Accepted, and its syncs run (a world of one: the average is this worker's)."""
    base, optimizer = _model()
    start = [p.detach().clone() for p in base.parameters()]
    model, opt = gradhub.prepare(
        base,
        optimizer,
        strategy="diloco",
        runtime=surviving,
        inner_steps=2,
        fragments=2,
        compress="bf16",
    )
    x = torch.randn(8, 4)
    for _ in range(4):  # both fragments sync twice
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    assert all(not torch.equal(p, s) for p, s in zip(base.parameters(), start, strict=True))
    model.close()


def test_diloco_refuses_overlap_and_servers_under_survival(surviving: gradhub.Runtime) -> None:
    with pytest.raises(UnsupportedByStrategyError, match="overlap= under `gradhub run --survive`"):
        gradhub.prepare(*_model(), strategy="diloco", runtime=surviving, inner_steps=4, overlap=1)
    with pytest.raises(UnsupportedByStrategyError, match="servers= under `gradhub run --survive`"):
        gradhub.prepare(
            *_model(),
            strategy="diloco",
            runtime=surviving,
            servers="tcp://127.0.0.1:1",
        )
