"""``sharded``'s survival state, on a group of 3 real processes with no death:
the mirrors, a step some ranks applied and others did not (finished on the
ranks behind with the gradient the ahead rank still holds), the slices set up
again from what each rank holds, and the loss of both holders of a slice.

A death itself, and the group rebuilt over the survivors, are in
``tests/jobs/test_survive_sharded.py``; here the runtime is marked surviving
(as ``gradhub run --survive`` marks it) and the membership change is given
to the strategy directly, so that which ranks applied the step is chosen,
not left to a race. The results are compared bit for bit with the same job
run without any change (a single process's would differ in the additions'
order; the finishing step uses the same gradient bits and optimizer code).
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import pytest
import torch

import gradhub
from gradhub.errors import StateLostError
from gradhub.runtime.membership import Regrouped
from harness import run_ranks

STEPS = 4


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(9, 6, generator=g), torch.randn(9, 3, generator=g)) for _ in range(STEPS)]


def _train(rank: int, world_size: int, cut_at: int | None, optimizer: str) -> bytes:
    """``STEPS`` steps on 3 ranks; at step ``cut_at`` rank 0 applies its slice
    (and its mirror, of rank 2's) and ranks 1 and 2 do not, then all are told
    of a change in which rank 0 is ahead: slice 1 is held by ranks behind only."""
    runtime = dataclasses.replace(gradhub.init(), survive=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ddp, dopt = gradhub.prepare(model, opt, strategy="sharded", runtime=runtime)
    strategy = ddp.strategy  # type: ignore[attr-defined]
    mirrors = [(m.start, m.length) for m in strategy._mirrors]
    for step, (x, y) in enumerate(_batches()):
        half = slice(rank * 3, rank * 3 + 3)
        dopt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x[half]), y[half]).backward()
        if step != cut_at:
            dopt.step()
            continue
        if rank == 0:  # its slice and mirror stepped; the weights never gathered
            grads = [p.grad for p in strategy.params]
            pieces = strategy._opt.pieces
            from gradhub.train.strategies.sharded_survival import piece_grads

            strategy._opt.step_pieces(piece_grads(pieces, grads))
            strategy._step_mirrors()
        for p in strategy.params:
            p.grad = None  # as a failed step's recovery drops them (the buffer stays)
        steps = [step + 1, step, step]
        done = Regrouped(1, [0, 1, 2], [], step + 1, 0, [1, 2], steps)
        strategy._regrouped(done)
        strategy._synced = False
    state = dopt.state_dict()
    out = {
        "params": {k: v.clone() for k, v in model.state_dict().items()},
        "state": state["state"],
        "mirrors": mirrors,
        "committed": runtime.committed_steps,
        "steps": strategy.steps,
    }
    ddp.close()
    runtime.close()
    buffer = io.BytesIO()  # tensors as bytes: the queue's shared-memory handles die with the rank
    torch.save(out, buffer)
    return buffer.getvalue()


def _run(cut_at: int | None, optimizer: str) -> list[dict[str, Any]]:
    results = run_ranks(_train, 3, cut_at, optimizer)
    return [torch.load(io.BytesIO(r.value), weights_only=False) for r in results]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_a_step_applied_on_one_rank_is_finished_on_the_other(optimizer: str) -> None:
    plain, cut = _run(None, optimizer), _run(2, optimizer)
    for rank in range(3):
        assert cut[rank]["committed"] == STEPS and cut[rank]["steps"] == STEPS
        for name, value in plain[0]["params"].items():
            assert torch.equal(cut[rank]["params"][name], value), (rank, name)
        for index, state in plain[0]["state"].items():
            for key, value in state.items():
                got = cut[rank]["state"][index][key]
                assert torch.equal(torch.as_tensor(got), torch.as_tensor(value)), (index, key)


def test_mirrors_hold_every_slice_on_another_rank() -> None:
    results = _run(None, "sgd")
    # Three ranks on one host: rank r holds slice r - 1's mirror.
    starts = [r["mirrors"][0][0] for r in results]
    assert starts[1] == 0 and 0 < starts[2] < starts[0]


class _Holder:
    """The parts of the strategy the assembly reads."""

    from gradhub.train.strategies.sharded_survival import ShardedSurvival

    _assemble = ShardedSurvival._assemble

    def __init__(self) -> None:
        self.params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))]
        self._flat = torch.zeros(6)


def test_a_slice_whose_two_holders_died_is_state_lost() -> None:
    holder = _Holder()
    weights = torch.arange(6, dtype=torch.float32)
    state = {"momentum_buffer": torch.ones(4)}
    slice_0 = (0, weights[:3], [(0, 0, {"momentum_buffer": state["momentum_buffer"][:3]})])
    slice_2 = (
        3,
        weights[3:],
        [(0, 3, {"momentum_buffer": torch.ones(1)}), (1, 0, {"momentum_buffer": torch.ones(2)})],
    )
    master, whole = holder._assemble([[slice_0], [slice_2]], [])  # type: ignore[arg-type]
    assert torch.equal(master, weights) and whole[0]["momentum_buffer"].shape == (4,)
    gathered: list[Any] = [([slice_0], {"holders": {0: (0, 1), 3: (1, 0)}})]
    with pytest.raises(StateLostError, match=r"elements 3\.\. .* ranks 1 \(its owner\) and 0"):
        holder._assemble([[slice_0]], gathered)  # type: ignore[arg-type]
