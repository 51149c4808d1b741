"""Parameter-server strategies against real server processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import gradhub
from gradhub.ps.server.config import ServerConfig
from gradhub.ps.server.launch import ServerHandle, start_server
from gradhub.train.strategies import make_strategy
from harness import run_ranks
from train_helpers import fixed_data, reference_step, sgd, tiny_model, uneven_steps


@pytest.fixture
def sync_server() -> Iterator[ServerHandle]:
    config = ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=0.5, momentum=0.9)
    with start_server(config) as handle:
        yield handle


@pytest.mark.slow
def test_ps_sync_uneven_batches_equal_single_process_steps(sync_server: ServerHandle) -> None:
    # Rank 0 initialises the keys; the servers hold the optimizer.
    options = {"servers": [sync_server.address], "timeout": 30}
    results = run_ranks(uneven_steps, 2, "ps-sync", options, False, timeout=90)
    expected = reference_step(sgd, steps=3)
    for r in results:
        for got, want in zip(r.value, expected, strict=True):
            # The server sums 5/8 * mean5 + 3/8 * mean3 (float32) and runs the same
            # SGD: equal to the 8-sample step up to reordered float32 sums.
            torch.testing.assert_close(torch.from_numpy(got), want, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_wrong_mode_and_unreachable_servers_are_clear_errors(sync_server: ServerHandle) -> None:
    runtime = gradhub.init(timeout=10)
    try:
        wrong = make_strategy("ps-async", servers=[sync_server.address], timeout=5)
        with pytest.raises(gradhub.GradhubError, match="needs servers in mode 'async'"):
            wrong.setup(tiny_model(), None, runtime)
        wrong.close()
        gone = make_strategy("ps-sync", servers=["tcp://127.0.0.1:9"], timeout=1)
        with pytest.raises(gradhub.GradhubError, match=r"127.0.0.1:9 unreachable"):
            gone.setup(tiny_model(), None, runtime)
        gone.close()
    finally:
        runtime.close()


def test_a_restarted_ps_sync_worker_catches_up_with_the_steps_of_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before a failure, worker 1 pushed 3 steps that worker 0's predecessor
    never matched. After the restart, worker 0 pads with zero pushes first, so
    those sync rounds complete (with worker 1's sums unchanged) instead of
    waiting at the end of the job for pushes that never come."""
    config = ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=0.5)
    model = tiny_model()
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    with start_server(config, in_thread=True) as server:
        with gradhub.RemoteParameterServer(server.address, worker_id=1, timeout=10) as other:
            for name, p in model.named_parameters():
                other.init(name, p.detach())
            for _ in range(3):
                for name, p in model.named_parameters():
                    other.push(name, torch.ones_like(p)).result(10)  # joined its round
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        with gradhub.init(timeout=10) as runtime:  # worker 0 of the restarted job
            strategy = make_strategy("ps-sync", servers=[server.address], timeout=10)
            strategy.setup(model, None, runtime)
            report = strategy._client.stats()[0]
            strategy.close()
    keys = len(start)
    assert report["push_applied_by_worker"] == {"0": 3 * keys, "1": 3 * keys}
    assert set(report["rounds_applied"].values()) == {3}
    for name, p in model.named_parameters():  # pulled after the rounds: 3 x SGD(lr=0.5) of 1
        torch.testing.assert_close(p.detach(), start[name] - 1.5, rtol=0, atol=1e-6)


def test_a_restarted_ps_worker_takes_the_servers_values_and_its_checkpointed_lr(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A worker restarted by torchrun resumes its step and its LR schedule from
    the checkpoint, and the parameters from the servers, which went on after it.
    The workers join the agent's store, which torchrun keeps for every attempt."""
    x, y = fixed_data(12)
    agent = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    launcher = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    for name, value in {**launcher, "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(agent.port))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    with start_server(ServerConfig(mode="async"), in_thread=True) as server:

        def attempt(restart: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
            monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
            model = tiny_model()
            opt = torch.optim.SGD(model.parameters(), lr=0.4)
            with gradhub.init(timeout=10) as runtime:
                options = {"servers": [server.address], "timeout": 10}
                with gradhub.DataParallelTrainer(
                    model, opt, strategy="ps-async", runtime=runtime, **options
                ) as trainer:
                    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
                    trainer.fit(
                        (x, y),
                        epochs=2,
                        batch_size=4,
                        run_dir=tmp_path,  # checkpoints in tmp_path/checkpoints
                        progress=False,
                        lr_scheduler=schedule,
                        scheduler_interval="epoch",
                    )
            return model, opt

        attempt(0)
        with gradhub.RemoteParameterServer(server.address, worker_id=7, timeout=10) as other:
            for name, p in tiny_model().named_parameters():  # acknowledged after the checkpoint
                other.push(name, torch.ones_like(p)).result(10)
            values = {}
            for name, p in tiny_model().named_parameters():
                values[name] = torch.empty_like(p)
                other.pull(name, values[name]).result(10)
        model, opt = attempt(1)  # the job had finished: nothing left but resuming
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # 0.4 halved after each epoch
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), values[name]), name
