"""The server-side optimizer comes from one OptimizerSpec: per key from ``init``, fixed by
the server, hyperparameters with a push, ``--optimizer none``; local and remote alike.

References are plain torch optimizers stepped in this process on the same gradients;
the server runs the same float operations on the same values, so results are
compared exactly (``torch.equal``) unless a comment says otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gradhub import LocalParameterServer, RemoteParameterServer, ServerConfig, start_server
from gradhub.errors import InvalidOptionError, OptimizerMismatchError, ShapeMismatchError
from gradhub.optim import OptimizerSpec
from gradhub.ps.server.launch import ServerHandle

ADAM = OptimizerSpec.of("adam", lr=0.05, betas=(0.8, 0.99))


def _grads(n: int, shape: tuple[int, ...] = (5,)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=gen) for _ in range(n)]


def _reference(spec: OptimizerSpec, start: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    value = start.clone().requires_grad_(True)
    opt = spec.build([value])
    for g in grads:
        value.grad = g.clone()
        opt.step()
    return value.detach()


def _reference_state(
    spec: OptimizerSpec, start: torch.Tensor, grads: list[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reference's value and its optimizer's state for that value."""
    value = start.clone().requires_grad_(True)
    opt = spec.build([value])
    for g in grads:
        value.grad = g.clone()
        opt.step()
    return value.detach(), dict(opt.state[value])


def _same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.fixture
def open_server() -> Iterator[ServerHandle]:
    with start_server(ServerConfig(), in_thread=True) as handle:  # no optimizer of its own
        yield handle


def test_local_key_takes_the_init_spec_and_a_fixed_server_refuses_another() -> None:
    start, grads = torch.ones(5), _grads(4)
    with LocalParameterServer() as ps:
        ps.init("w", start, optimizer=ADAM)
        ps.init("plain", start)  # no spec, no server optimizer: a push replaces the value
        for g in grads:
            ps.push("w", g)
            ps.push("plain", g)
        out = torch.empty(5)
        ps.pull("w", out).result(10)
        assert torch.equal(out, _reference(ADAM, start, grads))
        ps.pull("plain", out).result(10)
        assert torch.equal(out, grads[-1])
    with LocalParameterServer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1)) as fixed:
        fixed.init("same", start, optimizer=OptimizerSpec.of("sgd", lr=0.1))
        with pytest.raises(OptimizerMismatchError, match=r"Adam\(lr=0.05.*SGD\(lr=0.1"):
            fixed.init("other", start, optimizer=ADAM)
        assert fixed.keys() == ["same"]  # nothing stored for the refused init


def test_local_optimizer_state_reads_and_sets_the_single_process_state() -> None:
    start, grads = torch.ones(5), _grads(4)
    value, state = _reference_state(ADAM, start, grads[:3])
    with LocalParameterServer() as ps:
        ps.init("w", start, optimizer=ADAM)
        assert ps.optimizer_state("w", start) == {}  # before the first update
        for g in grads[:3]:
            ps.push("w", g)  # queued: the state is read after them
        _same_state(ps.optimizer_state("w", start), state)
        ps.init("copy", value, optimizer=ADAM)
        ps.set_optimizer_state("copy", state, value)
        ps.push("copy", grads[3])
        out = torch.empty(5)
        ps.pull("copy", out).result(10)
        with pytest.raises(ShapeMismatchError, match=r"'exp_avg'.*\[5\].*\[4\]"):
            ps.set_optimizer_state("copy", {**state, "exp_avg": torch.zeros(4)})
        ps.init("plain", start)
        with pytest.raises(ValueError, match="no optimizer"):
            ps.optimizer_state("plain")
    # The server continued from the copied state as the single process does.
    assert torch.equal(out, _reference(ADAM, start, grads))


@pytest.mark.slow
def test_remote_key_takes_the_init_spec_on_every_slice() -> None:
    start = torch.randn(64, 33, generator=torch.Generator().manual_seed(1))
    grads = _grads(3, (64, 33))
    with (
        start_server(ServerConfig(), in_thread=True) as a,
        start_server(ServerConfig(), in_thread=True) as b,
        RemoteParameterServer([a.address, b.address], worker_id=1, slice_bytes=1024) as ps,
    ):
        ps.init("big", start, optimizer=ADAM)  # 8 KB: one slice per server
        for g in grads[:2]:
            ps.push("big", g).result(10)
        # The slices' states put together: the single-process optimizer's state.
        value, state = _reference_state(ADAM, start, grads[:2])
        _same_state(ps.optimizer_state("big", start), state)
        ps.init("copy", value, optimizer=ADAM)
        ps.set_optimizer_state("copy", state, value)  # each slice takes its part
        ps.push("copy", grads[2]).result(10)
        ps.push("big", grads[2]).result(10)
        out, copied = torch.empty_like(start), torch.empty_like(start)
        ps.pull("big", out).result(10)
        ps.pull("copy", copied).result(10)
        assert sum(s["keys"] for s in ps.stats()) == 4
    # Adam is elementwise: every slice runs the same float operations as the whole.
    assert torch.equal(out, _reference(ADAM, start, grads))
    assert torch.equal(copied, out)


@pytest.mark.slow
def test_remote_default_is_sgd_lr_0_01(open_server: ServerHandle) -> None:
    with RemoteParameterServer(open_server.address, worker_id=1) as ps:
        ps.init("d", torch.ones(3))
        ps.push("d", torch.ones(3)).result(10)
        out = torch.empty(3)
        ps.pull("d", out).result(10)
    assert torch.equal(
        out, _reference(OptimizerSpec.of("sgd", lr=0.01), torch.ones(3), [torch.ones(3)])
    )


@pytest.mark.slow
def test_remote_fixed_optimizer_refuses_another_spec_naming_both() -> None:
    with (
        start_server(ServerConfig(optimizer="adam", lr=1e-3), in_thread=True) as server,
        RemoteParameterServer(server.address, worker_id=1, timeout=10) as ps,
    ):
        with pytest.raises(OptimizerMismatchError) as err:
            ps.init("w", torch.ones(2), optimizer=OptimizerSpec.of("sgd", lr=0.1))
        text = str(err.value)
        assert "SGD(lr=0.1" in text and "Adam(lr=0.001" in text and server.address in text
        ps.init("w", torch.ones(2), optimizer=OptimizerSpec.of("adam", lr=1e-3))  # the same: fine


@pytest.mark.slow
def test_push_hyperparameters_follow_a_worker_lr_schedule(open_server: ServerHandle) -> None:
    spec = OptimizerSpec.of("sgd", lr=0.1, momentum=0.9)
    start, grads = torch.ones(4), _grads(5, (4,))
    value = start.clone().requires_grad_(True)
    opt = spec.build([value])
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    with RemoteParameterServer(open_server.address, worker_id=1) as ps:
        ps.init("w", start, optimizer=spec)
        for g in grads:
            lr = opt.param_groups[0]["lr"]
            ps.push("w", g, hyperparameters={"lr": lr}).result(10)
            value.grad = g.clone()
            opt.step()
            sched.step()
        out = torch.empty(4)
        ps.pull("w", out).result(10)
        # The server's refusal comes back as the same class (a ValueError).
        with pytest.raises(InvalidOptionError, match="no hyperparameter"):
            ps.push("w", grads[0], hyperparameters={"bogus": 1}).result(10)
        ps.pull("w", out).result(10)  # the refused push changed nothing
    assert torch.equal(out, value.detach())


@pytest.mark.slow
def test_optimizer_none_matches_local_without_optimizer() -> None:
    grads = _grads(6, (3,))
    with LocalParameterServer(optimizer=None) as local:
        local.init("k", torch.zeros(3))
        for i in range(0, 6, 2):
            local.push("k", [grads[i], grads[i + 1]])
        expected = torch.empty(3)
        local.pull("k", expected).result(10)
    with (
        start_server(ServerConfig(optimizer="none"), in_thread=True) as server,
        RemoteParameterServer(server.address, worker_id=1, timeout=10) as ps,
    ):
        ps.init("k", torch.zeros(3))
        for i in range(0, 6, 2):
            ps.push("k", [grads[i], grads[i + 1]]).result(10)
        out = torch.empty(3)
        ps.pull("k", out).result(10)
        with pytest.raises(OptimizerMismatchError, match="no optimizer"):
            ps.init("k2", torch.zeros(3), optimizer=ADAM)
    assert torch.equal(out, expected)  # the last pushed sum, both ways
    assert torch.equal(out, grads[4] + grads[5])


@pytest.mark.slow
def test_a_key_keeps_its_spec_and_state_across_a_restart(tmp_path: Path) -> None:
    config = ServerConfig(checkpoint_dir=str(tmp_path), name="opt")
    start, grads = torch.ones(5), _grads(4)
    state = _reference_state(ADAM, start, grads[:2])[1]
    with (
        start_server(config, in_thread=True) as server,
        RemoteParameterServer(server.address, worker_id=1) as ps,
    ):
        ps.init("w", start, optimizer=ADAM)
        for g in grads[:2]:
            ps.push("w", g).result(10)
        ps.init("s", start, optimizer=ADAM)
        ps.set_optimizer_state("s", state, start)  # a state set, not stepped into
    with (
        start_server(config, in_thread=True) as server,  # restored from the checkpoint
        RemoteParameterServer(server.address, worker_id=1) as ps,
    ):
        _same_state(ps.optimizer_state("w", start), state)
        _same_state(ps.optimizer_state("s", start), state)
        for g in grads[2:]:
            ps.push("w", g).result(10)
        out = torch.empty(5)
        ps.pull("w", out).result(10)
    assert torch.equal(out, _reference(ADAM, start, grads))


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_store_sgd_gives_torch_sgd_bits_with_a_changing_lr(momentum: float) -> None:
    # Plain SGD is applied as value.add_(grad, alpha=-lr) without Optimizer.step;
    # with momentum the step is torch's own. Both must be torch's bits.
    from gradhub.ps.server.store import ParameterStore

    spec = OptimizerSpec.of("sgd", lr=0.1, momentum=momentum)
    start, grads = torch.randn(1000, generator=torch.Generator().manual_seed(1)), _grads(5, (1000,))
    store = ParameterStore(spec)
    store.init("w", start)
    value = start.clone().requires_grad_(True)
    opt = spec.build([value])
    for i, g in enumerate(grads):
        if i == 3:
            store.set_hyperparameters("w", {"lr": 0.037})
            opt.param_groups[0]["lr"] = 0.037
        store.apply("w", g)
        value.grad = g.clone()
        opt.step()
    assert torch.equal(store.value("w"), value.detach())
