"""Asynchronous data-parallel training with worker threads and a coordinator.

Each worker thread walks the same shuffled mini-batches, takes its round-robin
share of each (:func:`~gradhub.inprocess.merge.split_batch`), computes the gradient of a
softmax classifier on the coordinator's current parameters, and adds it to a
:class:`~gradhub.inprocess.coordinator.DistributedGradientsCoordinator` that applies it
at once (asynchronous SGD: a worker may compute on parameters a few steps old).

Decisions:

- Each worker sends the gradient of the *sum* of its samples' losses divided
  by the full mini-batch size, so the shares of one batch add up to the
  batch's mean gradient; the coordinator's learning rate is the step size.
- Workers scale their own gradients (the coordinator applies them whole):
  each multiplies by a cosine decay over its steps, so the asynchronous
  updates settle at the end instead of leaving the last noisy step.
- The model is multinomial logistic regression (``logits = x @ W + b``) with
  its gradient written out (``x^T (softmax - onehot)``): exact and cheap.
- The data set is scikit-learn's bundled digits (1,797 8x8 images, no
  download), split train/test with the seed; each pixel is standardised with
  the training set's mean and standard deviation (plus 0.1, as border pixels
  are nearly constant), which lets plain SGD converge in a few epochs.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

import torch

from gradhub.errors import InvalidOptionError
from gradhub.inprocess import DistributedGradientsCoordinator, split_batch

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ThreadedConfig:
    """Settings of a threaded coordinator run."""

    workers: int = 4
    """Worker threads adding gradients."""
    epochs: int = 20
    """Passes over the training set (each worker sees its share of every batch)."""
    batch_size: int = 64
    """Samples per mini-batch, split across the workers."""
    learning_rate: float = 0.5
    """Coordinator step size for each (batch-mean-scaled) worker gradient."""
    test_fraction: float = 0.25
    """Share of the data held out for the test accuracy."""
    seed: int = 0
    """Seeds the train/test split and the batch order."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise InvalidOptionError(f"workers must be >= 1, got {self.workers}")
        if self.epochs < 1:
            raise InvalidOptionError(f"epochs must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise InvalidOptionError(f"batch_size must be >= 1, got {self.batch_size}")
        if not 0.0 < self.test_fraction < 1.0:
            raise InvalidOptionError(f"test_fraction must be in (0, 1), got {self.test_fraction}")
        if not self.learning_rate > 0:
            raise InvalidOptionError(f"learning_rate must be > 0, got {self.learning_rate}")


@dataclass(frozen=True)
class ThreadedResult:
    """What a threaded run produced."""

    test_accuracy: float
    train_loss: float
    gradients_applied: int
    wall_seconds: float

    @property
    def gradients_per_second(self) -> float:
        return self.gradients_applied / self.wall_seconds if self.wall_seconds > 0 else 0.0


def load_digits_split(
    test_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Digits as ``(x_train, y_train, x_test, y_test)``, standardised on the training set."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # an optional extra
        raise ImportError(
            "the digits demo needs scikit-learn: pip install 'gradhub[demo]'"
        ) from exc
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = round(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    mean, scale = x[train].mean(0), x[train].std(0) + 0.1
    x = (x - mean) / scale
    return x[train], y[train], x[test], y[test]


def softmax_loss_and_grads(
    params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor, scale: float
) -> tuple[float, dict[str, torch.Tensor]]:
    """Summed cross-entropy of ``(x, y)`` and its gradient, both times ``scale``."""
    logits = x @ params["weight"] + params["bias"]
    log_probs = torch.log_softmax(logits, dim=1)
    loss = -log_probs[torch.arange(len(y)), y].sum().item() * scale
    delta = log_probs.exp()
    delta[torch.arange(len(y)), y] -= 1.0
    return loss, {"weight": (x.T @ delta) * scale, "bias": delta.sum(0) * scale}


def cosine_factor(step: int, total_steps: int) -> float:
    """Cosine decay from 1 to 0 over ``total_steps`` steps."""
    return 0.5 * (1.0 + math.cos(math.pi * step / total_steps))


def accuracy(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> float:
    predicted = (x @ params["weight"] + params["bias"]).argmax(dim=1)
    return float((predicted == y).float().mean())


def train_softmax_threaded(config: ThreadedConfig) -> ThreadedResult:
    """Train a softmax classifier on digits with ``config.workers`` threads."""
    x_train, y_train, x_test, y_test = load_digits_split(config.test_fraction, config.seed)
    n_classes = int(y_train.max()) + 1
    params = {
        "weight": torch.zeros(x_train.shape[1], n_classes),
        "bias": torch.zeros(n_classes),
    }
    coord = DistributedGradientsCoordinator("descent", learning_rate=config.learning_rate)
    coord.set_model_parameters(params, copy=True)

    # Every worker walks the same batches, so the order is drawn once here.
    gen = torch.Generator().manual_seed(config.seed)
    epochs = [torch.randperm(len(y_train), generator=gen) for _ in range(config.epochs)]
    total_steps = config.epochs * math.ceil(len(y_train) / config.batch_size)
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        try:
            step = 0
            for order in epochs:
                for start in range(0, len(order), config.batch_size):
                    batch = order[start : start + config.batch_size]
                    mine = split_batch(batch, config.workers)[rank]
                    step += 1
                    if len(mine) == 0:
                        continue
                    current = coord.get_model_parameters(copy=True)
                    scale = cosine_factor(step - 1, total_steps) / len(batch)
                    _, grads = softmax_loss_and_grads(current, x_train[mine], y_train[mine], scale)
                    coord.add_gradients(grads, copy=False)
        except BaseException as exc:  # reported to the caller below
            logger.exception("worker %d failed", rank)
            errors.append(exc)

    started = time.perf_counter()
    with coord:
        threads = [
            threading.Thread(target=worker, args=(r,), name=f"gradhub-demo-worker-{r}")
            for r in range(config.workers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - started
    if errors:
        raise errors[0]

    final = coord.get_model_parameters(copy=False)
    train_loss, _ = softmax_loss_and_grads(final, x_train, y_train, 1.0 / len(y_train))
    result = ThreadedResult(
        test_accuracy=accuracy(final, x_test, y_test),
        train_loss=train_loss,
        gradients_applied=coord.applied,
        wall_seconds=wall,
    )
    logger.info(
        "threads: %d workers, %d gradients in %.2fs, test accuracy %.4f",
        config.workers,
        result.gradients_applied,
        wall,
        result.test_accuracy,
    )
    return result
