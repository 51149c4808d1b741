"""What ``fit`` makes of a batch and the model's output: the inputs, the target,
the default loss, accuracy, and the per-rank sums of loss and metrics.

Decisions:
- A tuple/list batch is ``(inputs, targets, ...)``: the model gets
  ``inputs``. A dict batch goes to the model whole (``model(batch)``); its
  target is the first of the keys ``target``, ``targets``, ``labels``, ``y``.
- ``loss_fn(output, batch)`` returns the mean loss of the batch. Default: an
  output dict's ``"loss"`` if it has one; otherwise cross-entropy of the
  logits (the output, or its ``"logits"``) against integer targets, flattened
  so ``(B, T, V)`` logits against ``(B, T)`` targets work; mean squared error
  against floating-point targets.
- ``metrics=`` names what is reported beside the loss (default
  ``("accuracy",)``). Accuracy is reported where it applies (logits with one
  more dimension than integer targets: per sample, or per token for
  ``(B, T, V)``), otherwise ``None``; also ``None`` when ``"accuracy"`` is
  not in ``metrics``. ``"loss"`` is always reported. Callables
  ``metric(output, batch) -> float`` (a mean over the batch) are reported as
  ``train_<name>`` / ``eval_<name>``, averaged over the samples of every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gradhub.errors import WrongTypeError

__all__ = [
    "LossFn",
    "Metric",
    "Stats",
    "correct",
    "default_loss",
    "detach",
    "inputs_of",
    "target_of",
]

LossFn = Callable[[Any, Any], torch.Tensor]
Metric = Callable[[Any, Any], float]
_TARGET_KEYS = ("target", "targets", "labels", "y")


def inputs_of(batch: Any) -> Any:
    if isinstance(batch, (tuple, list)):
        return batch[0]
    return batch


def target_of(batch: Any) -> Any:
    if isinstance(batch, (tuple, list)):
        return batch[1] if len(batch) > 1 else None
    if isinstance(batch, dict):
        return next((batch[k] for k in _TARGET_KEYS if k in batch), None)
    return None


def _logits(output: Any) -> Any:
    return output.get("logits") if isinstance(output, dict) else output


def default_loss(output: Any, batch: Any) -> torch.Tensor:
    """See the module docstring."""
    if isinstance(output, dict) and "loss" in output:
        loss: torch.Tensor = output["loss"]
        return loss
    logits, target = _logits(output), target_of(batch)
    if not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor):
        raise WrongTypeError(
            "the default loss needs a tensor output (or a dict with 'loss' or 'logits') and "
            "a target in the batch\n- help: pass loss_fn=lambda output, batch: ..."
        )
    if target.is_floating_point():
        return torch.nn.functional.mse_loss(logits.float(), target)
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), target.flatten())


def correct(output: Any, batch: Any) -> tuple[float, float] | None:
    """(correct predictions, predictions) where accuracy applies, else ``None``."""
    logits, target = _logits(output), target_of(batch)
    if (
        isinstance(logits, torch.Tensor)
        and isinstance(target, torch.Tensor)
        and not target.is_floating_point()
        and logits.ndim == target.ndim + 1
        and logits.shape[:-1] == target.shape
    ):
        return float((logits.argmax(-1) == target).sum()), float(target.numel())
    return None


class Stats:
    """Sums of one epoch (or one evaluation) on this rank: loss, accuracy, metrics."""

    def __init__(self, metrics: dict[str, Metric], accuracy: bool = True) -> None:
        self.metrics = metrics
        self.accuracy = accuracy
        self.values = torch.zeros(4 + len(metrics), dtype=torch.float64)

    def add(self, output: Any, batch: Any, loss: float, samples: int) -> None:
        v = self.values
        v[0] += loss * samples
        v[1] += samples
        hits = correct(output, batch) if self.accuracy else None
        if hits is not None:
            v[2] += hits[0]
            v[3] += hits[1]
        for i, fn in enumerate(self.metrics.values()):
            v[4 + i] += float(fn(output, batch)) * samples

    def summary(self, prefix: str, summed: torch.Tensor) -> dict[str, Any]:
        loss, n, hits, count = summed[:4].tolist()
        out: dict[str, Any] = {
            f"{prefix}loss": loss / n if n else None,
            f"{prefix}accuracy": hits / count if count else None,
        }
        for i, name in enumerate(self.metrics):
            out[f"{prefix}{name}"] = float(summed[4 + i]) / n if n else None
        return out


def detach(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output.detach()
    if isinstance(output, dict):
        return {k: detach(v) for k, v in output.items()}
    return output
