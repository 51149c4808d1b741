"""OptimizerSpec: one optimizer representation, rebuilt anywhere from JSON."""

import json

import pytest
import torch

from gradhub.optim import OptimizerSpec, optimizer_class


def _roundtrip(spec: OptimizerSpec) -> OptimizerSpec:
    return OptimizerSpec.from_dict(json.loads(json.dumps(spec.to_dict())))


@pytest.mark.parametrize(
    ("cls", "hyper"),
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        (torch.optim.Adam, {"lr": 2e-3, "betas": (0.8, 0.99)}),
        (torch.optim.AdamW, {"lr": 3e-4, "weight_decay": 0.05}),
        (torch.optim.RMSprop, {"lr": 1e-2, "alpha": 0.9}),
    ],
)
def test_a_rebuilt_optimizer_steps_exactly_like_the_original(cls, hyper):
    torch.manual_seed(0)
    w = torch.randn(5, requires_grad=True)
    original = cls([w], **hyper)
    spec = _roundtrip(OptimizerSpec.of(original))
    assert spec == OptimizerSpec.of(cls, **hyper) == OptimizerSpec.of(cls.__name__.lower(), **hyper)
    w2 = w.detach().clone().requires_grad_(True)
    rebuilt = spec.build([w2])
    for step in range(3):
        g = torch.randn(5, generator=torch.Generator().manual_seed(step))
        for opt, p in ((original, w), (rebuilt, w2)):
            p.grad = g.clone()
            opt.step()
    assert torch.equal(w, w2)


def test_groups_and_scheduler_keys_survive():
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    opt = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)  # adds initial_lr to every group
    spec = _roundtrip(OptimizerSpec.of(opt))
    assert [g["lr"] for g in spec.groups] == [0.1, 0.5]
    fresh_a, fresh_b = (t.detach().clone().requires_grad_(True) for t in (a, b))
    built = spec.build([[fresh_a], [fresh_b]])
    assert [g["initial_lr"] for g in built.param_groups] == [0.1, 0.5]
    scheduler = torch.optim.lr_scheduler.StepLR(built, step_size=1, gamma=0.5)
    built.step()  # no gradients: a no-op that keeps the scheduler's order check quiet
    scheduler.step()
    assert [g["lr"] for g in built.param_groups] == [0.05, 0.25]
    assert spec.factory(1)([fresh_b]).param_groups[0]["lr"] == 0.5
    with pytest.raises(ValueError, match="1 parameter groups given"):
        spec.build([[a]])


def test_what_cannot_be_rebuilt_is_a_clear_error():
    class Custom(torch.optim.SGD):
        pass

    w = torch.zeros(1, requires_grad=True)
    with pytest.raises(TypeError, match=r"not a torch\.optim optimizer"):
        OptimizerSpec.of(Custom([w], lr=0.1))
    with pytest.raises(ValueError, match=r"unknown optimizer 'sgdd'.*SGD"):
        optimizer_class("sgdd")
    with pytest.raises(TypeError, match=r"SGD.*unexpected keyword"):
        OptimizerSpec.of("sgd", lr=0.1, betas=(0.9, 0.9))
    with pytest.raises(ValueError, match="'name'"):
        OptimizerSpec.from_dict({"name": "SGD"})
    with pytest.raises(ValueError, match="must be finite"):
        OptimizerSpec("SGD", ({"lr": float("nan")},))
    with pytest.raises(TypeError, match="instance carries its own"):
        OptimizerSpec.of(torch.optim.SGD([w], lr=0.1), lr=0.2)
