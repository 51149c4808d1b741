"""Split a batch across workers and merge their updates.

The two functions behind :class:`~gradhub.DataParallelTrainer`'s
``split_batch`` and ``merge_worker_updates``, exported by :mod:`gradhub` too:

- :func:`split_batch`: sample ``i`` goes to worker ``i % n``, order kept, always
  exactly ``n`` parts (some empty when there are fewer samples than workers).
- :func:`merge_worker_updates`: the average of the workers' gradients weighted
  by the samples each processed, so uneven shares are exact.

Decisions:

- ``split_batch`` keeps the container type: a tensor gives tensors, a NumPy
  array gives arrays, a dict gives dicts and a tuple of columns gives tuples.
  A *tuple* whose items are all tensors/arrays is read as columns such as
  ``(x, y)`` and split consistently; pass a *list* for a sequence of samples.
  Any other sequence gives lists.
- ``merge_worker_updates`` computes ``sum(s_i * g_i) / sum(s_i)`` in float64,
  adding the updates in ``worker_id`` order, so the result does not depend on
  the order of the input list (bit for bit). Each averaged leaf comes back in
  its input dtype if that is floating point, else fp32.
- A worker with 0 samples contributes nothing: its loss is ignored (the mean
  of no samples is often NaN) and its gradients may be ``None``; if given they
  must still match the others' structure.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gradhub.errors import InvalidOptionError, ShapeMismatchError, WrongTypeError
from gradhub.trees import Tree, TreeSpec, as_tree


@dataclass(frozen=True)
class WorkerUpdate:
    """What one worker reports for one step."""

    worker_id: Hashable
    """Identifies the worker; unique within one merge."""
    gradients: Tree
    """Gradient tensor or tree (NumPy accepted); may be ``None`` when no samples."""
    loss: float
    """Mean loss over the worker's samples."""
    samples_processed: int
    """Number of samples behind ``gradients`` and ``loss`` (>= 0)."""


@dataclass(frozen=True)
class ModelUpdate:
    """The merged update of one step."""

    averaged_gradients: Tree
    """Sample-weighted mean of the workers' gradients (same structure)."""
    mean_loss: float
    """Sample-weighted mean of the workers' losses."""
    total_samples: int
    """Sum of the samples processed by all workers."""


def _is_array(x: object) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray))


def _take(data: Any, start: int, step: int) -> Any:
    if isinstance(data, torch.Tensor):
        return data[start::step].contiguous()
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data[start::step])
    return list(data[start::step])


def _length(data: Any, what: str) -> int:
    if _is_array(data):
        if data.ndim == 0:
            raise InvalidOptionError(f"{what} is a 0-d tensor; split_batch needs a first dimension")
        return int(data.shape[0])
    if isinstance(data, Sequence) and not isinstance(data, (str, bytes)):
        return len(data)
    raise WrongTypeError(
        f"{what} must be a sequence, tensor or array (or a tuple/dict of them), "
        f"got {type(data).__name__}"
    )


def split_batch(data: Any, n_workers: int) -> list[Any]:
    """Split ``data`` round-robin into exactly ``n_workers`` parts.

    ``data`` may be a sequence of samples, a tensor or array (split on dim 0),
    or a tuple/dict of tensors/arrays with the same first dimension (split
    consistently). ``n_workers < 1`` is a ``ValueError``.
    """
    if isinstance(n_workers, bool) or not isinstance(n_workers, int) or n_workers < 1:
        raise InvalidOptionError(f"n_workers must be an integer >= 1, got {n_workers!r}")
    columns: dict[Any, Any] | None = None
    if isinstance(data, Mapping):
        columns = dict(data)
    elif isinstance(data, tuple) and data and all(_is_array(c) for c in data):
        columns = dict(enumerate(data))
    if columns is None:
        _length(data, "data")
        return [_take(data, w, n_workers) for w in range(n_workers)]
    lengths = {k: _length(v, f"data[{k!r}]") for k, v in columns.items()}
    if len(set(lengths.values())) > 1:
        raise InvalidOptionError(
            f"the columns of data have different first dimensions {lengths}; "
            "they must be equal to be split consistently"
        )
    parts = []
    for w in range(n_workers):
        part = {k: _take(v, w, n_workers) for k, v in columns.items()}
        parts.append(part if isinstance(data, Mapping) else tuple(part.values()))
    return parts


def _sort_key(update: WorkerUpdate) -> tuple[str, str]:
    return (type(update.worker_id).__name__, repr(update.worker_id))


def merge_worker_updates(updates: Sequence[WorkerUpdate]) -> ModelUpdate:
    """Merge the workers' updates, weighting each by its ``samples_processed``.

    Errors (each naming the worker): empty input, a negative or non-integer
    sample count, a duplicate ``worker_id``, gradients of a different
    structure or shape (``ShapeMismatchError``), and a total of 0 samples.
    """
    updates = list(updates)
    if not updates:
        raise InvalidOptionError("merge_worker_updates needs at least one WorkerUpdate, got none")
    seen: set[Hashable] = set()
    for u in updates:
        if not isinstance(u, WorkerUpdate):
            raise WrongTypeError(f"expected WorkerUpdate objects, got {type(u).__name__}")
        s = u.samples_processed
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise WrongTypeError(
                f"worker {u.worker_id!r}: samples_processed must be an integer, got {s!r}"
            )
        if s < 0:
            raise InvalidOptionError(f"worker {u.worker_id!r}: samples_processed is negative ({s})")
        if u.worker_id in seen:
            raise InvalidOptionError(
                f"worker {u.worker_id!r} appears twice; each worker reports once per merge"
            )
        seen.add(u.worker_id)
    try:
        ordered = sorted(updates, key=lambda u: u.worker_id)  # type: ignore[arg-type,return-value]
    except TypeError:  # worker ids of mixed, unorderable types
        ordered = sorted(updates, key=_sort_key)

    contributing = [u for u in ordered if u.samples_processed > 0]
    if not contributing:
        ids = ", ".join(repr(u.worker_id) for u in ordered)
        raise InvalidOptionError(f"total samples is 0 (workers {ids}); nothing to average")
    reference = as_tree(contributing[0].gradients)
    spec = TreeSpec.of(reference)

    total = sum(int(u.samples_processed) for u in contributing)
    sums: list[torch.Tensor] | None = None
    for u in ordered:
        if u.gradients is None and u.samples_processed == 0:
            continue
        try:
            grads = spec.leaves(u.gradients)
        except ShapeMismatchError as exc:
            raise ShapeMismatchError(
                f"worker {u.worker_id!r} {exc.path}", exc.expected, exc.received, exc.what
            ) from None
        except TypeError as exc:
            raise WrongTypeError(f"worker {u.worker_id!r}: {exc}") from None
        if u.samples_processed == 0:
            continue
        if sums is None:
            sums = [torch.zeros(g.shape, dtype=torch.float64, device=g.device) for g in grads]
        for acc, g in zip(sums, grads, strict=True):
            acc.add_(
                g.detach().to(device=acc.device, dtype=torch.float64), alpha=u.samples_processed
            )
    assert sums is not None  # contributing is non-empty

    leaf_dtypes = [
        s.dtype if s.dtype is not None and s.dtype.is_floating_point else torch.float32
        for s in spec.leaf_specs()
    ]
    averaged = [(acc / total).to(dtype) for acc, dtype in zip(sums, leaf_dtypes, strict=True)]
    mean_loss = math.fsum(float(u.loss) * u.samples_processed for u in contributing) / total
    return ModelUpdate(_rebuild(spec, averaged), mean_loss, total)


def _rebuild(spec: TreeSpec, leaves: list[torch.Tensor]) -> Tree:
    """A tree of ``spec``'s structure holding ``leaves`` (depth-first order)."""
    it = iter(leaves)

    def build(s: TreeSpec) -> Tree:
        if s.kind == "tensor":
            return next(it)
        kids = [build(c) for c in s.children]
        if s.kind == "dict":
            return dict(zip(s.keys, kids, strict=True))
        return kids if s.kind == "list" else tuple(kids)

    return build(spec)
