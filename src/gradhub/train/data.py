"""What ``fit`` trains on: every kind of data source, cut into this rank's batches.

``fit`` accepts:

- ``(inputs, targets)`` tensors or NumPy arrays, or a ``TensorDataset``;
- a map-style ``Dataset`` (items collated with torch's ``default_collate``,
  so items may be tuples or dicts);
- an ``IterableDataset``: every rank iterates it and keeps its own shard,
  items ``r, r + W, r + 2W, ...`` of each global batch (the dataset must yield
  the same sequence on every rank, as one that seeds its shuffling does);
- a ``DataLoader``: re-sharded over the ranks like ``DistributedSampler``
  (its dataset, per-rank ``batch_size``, ``collate_fn`` and ``num_workers``
  are kept; shuffled by ``seed`` and epoch if it shuffled: its sampler was a
  ``RandomSampler`` (``shuffle=True``) or a ``DistributedSampler`` with
  ``shuffle=True``, so a DDP script's loader works unchanged; another sampler,
  or a ``batch_sampler`` of its own, would be lost and is an error; as with
  ``DistributedSampler``, a dataset whose length the number of ranks does not
  divide has a few samples repeated, so that every rank gets as many); a
  loader over an ``IterableDataset`` hands its batches out round-robin, each
  rank one in turn.

For the first three, ``batch_size`` is the **global** batch size (what one
process would use): every epoch all ranks draw the same permutation (from
``seed`` and the epoch), cut it into global batches and split each one
round-robin, so a step is the single-process step on the global batch, the
last short batch included. Each step is a :class:`Step` with this rank's
batch and the sample counts the strategy weights by.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)
from torch.utils.data._utils.collate import default_collate

from gradhub.errors import InvalidOptionError, WrongTypeError
from gradhub.inprocess.merge import split_batch


@dataclass
class Step:
    """One rank's part of one global batch."""

    batch: Any
    """This rank's batch (``None`` when it has no sample in this global batch)."""
    samples: int
    """Samples in ``batch``."""
    global_samples: int | None
    """Samples of the global batch over every rank (``None``: not known here)."""


def batch_size_of(batch: Any) -> int:
    """Number of samples in a collated batch: the first dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        return batch_size_of(next(iter(batch.values())))
    if isinstance(batch, (tuple, list)):
        return batch_size_of(batch[0])
    raise WrongTypeError(f"cannot tell the batch size of a {type(batch).__name__}")


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def _columns(data: Any) -> TensorDataset | None:
    """A ``TensorDataset`` for an ``(inputs, targets)`` pair of tensors/arrays, else None."""
    if isinstance(data, TensorDataset):
        return data
    if isinstance(data, (tuple, list)) and len(data) == 2:
        cols = [
            torch.from_numpy(np.ascontiguousarray(c)) if isinstance(c, np.ndarray) else c
            for c in data
        ]
        if all(isinstance(c, torch.Tensor) for c in cols):
            if cols[0].shape[0] != cols[1].shape[0] or cols[0].shape[0] == 0:
                raise InvalidOptionError(
                    "inputs and targets need the same, non-zero number of samples, "
                    f"got {cols[0].shape[0]} and {cols[1].shape[0]}"
                )
            return TensorDataset(*cols)
    return None


def _check_loader(loader: DataLoader[Any], what: str) -> None:
    """A loader whose sampling ``fit`` would replace with a different one is an error."""
    kinds = (SequentialSampler, RandomSampler, DistributedSampler)
    if loader.batch_size is None or not isinstance(loader.sampler, kinds):
        own = (
            type(loader.batch_sampler).__name__
            if loader.batch_size is None
            else type(loader.sampler).__name__
        )
        raise WrongTypeError(
            f"{what} is a DataLoader with a {own} of its own; fit re-shards a loader over "
            "the ranks with a DistributedSampler, which would drop it\n- help: give the "
            "loader batch_size= and shuffle= (or a DistributedSampler), or draw the samples "
            "in an IterableDataset (the same sequence on every rank; fit keeps each rank's "
            "share)"
        )


def global_batches(
    size: int, batch_size: int, seed: int, epoch: int, shuffle: bool
) -> list[torch.Tensor]:
    """The indices of every global batch of ``epoch`` over ``size`` samples: a
    permutation drawn from ``seed`` and ``epoch`` (or the plain order), cut into
    batches of ``batch_size``; never a function of the world size. ``fit``'s
    batches and :class:`gradhub.GlobalBatchSampler`'s."""
    if shuffle:
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        order = torch.randperm(size, generator=g)
    else:
        order = torch.arange(size)
    return list(order.split(batch_size))


class Source:
    """One data argument of ``fit``; :meth:`epoch` yields this rank's :class:`Step` s."""

    def __init__(
        self,
        data: Any,
        *,
        what: str,
        batch_size: int,
        seed: int,
        shuffle: bool,
    ) -> None:
        self.rank, self.world = 0, 1  # set by fit once the job is joined
        self.seed, self.shuffle = seed, shuffle
        self.batch_size = batch_size
        self.loader: DataLoader[Any] | None = None
        self.dataset: Any = _columns(data)
        if self.dataset is None:
            if isinstance(data, DataLoader):
                self.loader = data
                self.dataset = data.dataset
            elif isinstance(data, (Dataset, IterableDataset)):
                self.dataset = data
            else:
                raise WrongTypeError(
                    f"{what} must be (inputs, targets) tensors or arrays, a Dataset, an "
                    f"IterableDataset or a DataLoader, got {type(data).__name__}"
                )
        self.iterable = isinstance(self.dataset, IterableDataset)
        if not self.iterable and len(self.dataset) == 0:
            raise InvalidOptionError(f"{what} holds no samples")
        if self.loader is not None and not self.iterable:
            _check_loader(self.loader, what)

    def steps_per_epoch(self) -> int | None:
        """Steps of one epoch, where the source can tell (not for iterable data)."""
        if self.iterable:
            return None
        n = len(self.dataset)
        if self.loader is not None:
            per_rank = -(-n // self.world)  # DistributedSampler pads to equal shards
            size = self.loader.batch_size or 1
            return per_rank // size if self.loader.drop_last else -(-per_rank // size)
        return -(-n // self.batch_size)

    def epoch(self, epoch: int, *, shuffle: bool | None = None) -> Iterator[Step]:
        shuffle = self.shuffle if shuffle is None else shuffle
        if self.iterable:
            return self._iterable()
        if self.loader is not None:
            return self._loader(epoch, shuffle)
        return self._indexed(epoch, shuffle)

    def _indexed(self, epoch: int, shuffle: bool) -> Iterator[Step]:
        for chunk in self.global_batches(epoch, shuffle=shuffle):
            yield self.share(chunk)

    @property
    def indexed(self) -> bool:
        """Whether a global batch is a list of indices (tensors, a map-style
        dataset), which any world size can split: what survival needs."""
        return not self.iterable and self.loader is None

    def global_batches(self, epoch: int, *, shuffle: bool | None = None) -> list[torch.Tensor]:
        """The indices of every global batch of ``epoch``: from the seed and the
        epoch only, never the world size."""
        shuffled = self.shuffle if shuffle is None else shuffle
        return global_batches(len(self.dataset), self.batch_size, self.seed, epoch, shuffled)

    def share(self, chunk: torch.Tensor) -> Step:
        """This rank's share of the global batch ``chunk`` (at the current
        :attr:`rank` and :attr:`world`)."""
        mine = split_batch(chunk, self.world)[self.rank]
        return Step(self._collate(mine), len(mine), len(chunk))

    def _collate(self, index: torch.Tensor) -> Any:
        if len(index) == 0:
            return None
        if isinstance(self.dataset, TensorDataset):
            return tuple(t[index] for t in self.dataset.tensors)
        return default_collate([self.dataset[int(i)] for i in index])

    def _loader(self, epoch: int, shuffle: bool) -> Iterator[Step]:
        assert self.loader is not None
        loader = self.loader
        was_shuffled = isinstance(loader.sampler, RandomSampler) or (
            isinstance(loader.sampler, DistributedSampler) and loader.sampler.shuffle
        )
        sampler: DistributedSampler[Any] = DistributedSampler(
            self.dataset,
            num_replicas=self.world,
            rank=self.rank,
            shuffle=was_shuffled and shuffle,
            seed=self.seed,
            drop_last=False,
        )
        sampler.set_epoch(epoch)
        sharded: DataLoader[Any] = DataLoader(
            self.dataset,
            batch_size=loader.batch_size,
            sampler=sampler,
            collate_fn=loader.collate_fn,
            num_workers=loader.num_workers,
            drop_last=loader.drop_last,
        )
        for batch in sharded:
            yield Step(batch, batch_size_of(batch), None)

    def _iterable(self) -> Iterator[Step]:
        source = self.loader if self.loader is not None else None
        items: Iterator[Any]
        if source is not None:  # a loader over an iterable dataset: its batches, round-robin
            batches = iter(source)
            for group in iter(lambda: list(itertools.islice(batches, self.world)), []):
                mine = group[self.rank] if self.rank < len(group) else None
                yield Step(mine, batch_size_of(mine) if mine is not None else 0, None)
            return
        items = iter(self.dataset)
        for chunk in iter(lambda: list(itertools.islice(items, self.batch_size)), []):
            mine = chunk[self.rank :: self.world]
            yield Step(default_collate(mine) if mine else None, len(mine), len(chunk))
