import math

import pytest
import torch

from gradhub.cli.main import main
from gradhub.demo.threads import (
    ThreadedConfig,
    accuracy,
    load_digits_split,
    train_softmax_threaded,
)


@pytest.mark.parametrize("seed", [0, 1])
def test_threaded_coordinator_training_reaches_90_percent(seed: int) -> None:
    # The README's setting (20 epochs). The threads' interleaving decides how
    # stale each gradient is, so the accuracy varies from run to run: over 30
    # runs each with two cores kept busy, seed 1 gave 0.931-0.953 at 20 epochs
    # (0.904-0.94 at 5, too close to the bound; once 0.886 in CI).
    config = ThreadedConfig(workers=4, epochs=20, learning_rate=1.0, seed=seed)
    result = train_softmax_threaded(config)
    assert result.test_accuracy >= 0.90
    # Every worker adds one gradient per mini-batch: 1348 training samples in
    # batches of 64 give 22 batches per epoch, each split over 4 workers.
    assert result.gradients_applied == 20 * 22 * 4
    # The rate is the count over the measured wall time, which is positive.
    assert result.wall_seconds > 0
    assert result.gradients_per_second == pytest.approx(
        result.gradients_applied / result.wall_seconds
    )
    # The loss that was trained on went down from ln(10) (chance, zero parameters).
    assert 0 < result.train_loss < 0.5 * math.log(10)


def test_accuracy_of_an_untrained_model_is_chance_level() -> None:
    # Guards the accuracy measure itself: all-zero parameters predict class 0.
    _, _, x_test, y_test = load_digits_split(0.25, seed=0)
    zeros = {"weight": torch.zeros(64, 10), "bias": torch.zeros(10)}
    assert accuracy(zeros, x_test, y_test) == pytest.approx(float((y_test == 0).float().mean()))
    assert accuracy(zeros, x_test, y_test) < 0.2


def test_gradhub_demo_command_prints_a_table(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "demo",
            "--strategy",
            "threads",
            "--workers",
            "2",
            "--epochs",
            "6",
            "--learning-rate",
            "1.0",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "threads" in out and "gradients applied/s" in out


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="workers"):
        ThreadedConfig(workers=0)
