"""``GlobalBatchSampler``: this rank's share of each global batch, in an own loop.

``DataLoader(dataset, batch_sampler=GlobalBatchSampler(dataset, 256))``
yields, on every rank, its share of each global batch of 256 samples.
Which samples form a global batch, and in which order, depends only on the
seed, the epoch (:meth:`GlobalBatchSampler.set_epoch`) and the step, never
on the number of ranks: the global batches are ``fit``'s (a permutation of
the dataset drawn from the seed and the epoch, cut into global batches),
each split round-robin over the ranks. Each share's sample count goes with
it to the prepared model, which weights this rank by its share of the batch
(as ``set_samples(n, global_n)``): a step is the single-process step on the
whole global batch, also when the ranks' shares differ by one.

In a surviving job (``gradhub run --survive``), after a step that a peer's
death interrupted, the sampler yields the same global batch again, split
over the survivors; its position is the number of committed steps
(:attr:`gradhub.Runtime.committed_steps`). A ``DataLoader`` with
``num_workers > 0`` asks for batches ahead of the loop (``prefetch_factor``
per worker): shares it fetched before a regroup are stale; the loop still
sees them, their steps send and apply nothing, and the sampler then
yields the batch to train again. To keep such a loader going until every
global batch is committed, the sampler may end an epoch with a few
one-sample placeholders (at most the loader's prefetch depth), which are
likewise trained locally and never applied. One backward per batch. Its
position in an epoch is the number of steps committed, epochs being
``len(sampler)`` steps each: call ``set_epoch`` before every epoch, and start a
replacement's loop (``runtime.replacement``) at epoch
``runtime.committed_steps // len(sampler)``.

A last global batch with fewer samples than ranks is dropped (a rank would
get an empty share); ``drop_last=True`` drops any last partial batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist

from gradhub.errors import InvalidOptionError, MisuseError
from gradhub.inprocess.merge import split_batch
from gradhub.runtime import BatchShare, Runtime, current
from gradhub.train.data import global_batches


class GlobalBatchSampler:
    """Yields this rank's share (a list of indices) of each global batch.

    ``dataset``: anything with a length (its items are not touched);
    ``global_batch_size``: samples per step over all ranks; ``shuffle``,
    ``seed``: a new permutation every epoch (``set_epoch``), the same on every
    rank; ``drop_last``: drop a last partial global batch. ``runtime``: the
    job's (default: the one ``gradhub.init()`` returned last).
    """

    def __init__(
        self,
        dataset: Sized,
        global_batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        runtime: Runtime | None = None,
    ) -> None:
        if isinstance(global_batch_size, bool) or not (
            isinstance(global_batch_size, int) and global_batch_size >= 1
        ):
            raise InvalidOptionError(
                f"global_batch_size must be an integer >= 1, got {global_batch_size!r}"
            )
        self.size = len(dataset)
        if self.size == 0:
            raise InvalidOptionError("the dataset holds no samples")
        self.global_batch_size = global_batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self._runtime = runtime

    def set_epoch(self, epoch: int) -> None:
        """Draw the next epoch's order (call it before each epoch, as for
        ``DistributedSampler``)."""
        self.epoch = epoch

    def global_batches(self, epoch: int | None = None) -> list[torch.Tensor]:
        """The indices of every global batch of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        chunks = global_batches(self.size, self.global_batch_size, self.seed, epoch, self.shuffle)
        if self.drop_last and len(chunks[-1]) < self.global_batch_size:
            chunks.pop()
        return chunks

    def __len__(self) -> int:
        """Global batches per epoch (steps, when none fails)."""
        return len(self.global_batches())

    def _where(self) -> tuple[Runtime | None, int, int]:
        rt = self._runtime if self._runtime is not None else current()
        if rt is not None:
            return rt, rt.rank, rt.world_size
        if dist.is_available() and dist.is_initialized():
            return None, dist.get_rank(), dist.get_world_size()
        return None, 0, 1

    def __iter__(self) -> Iterator[list[int]]:
        chunks = self.global_batches()
        rt, rank, world = self._where()
        if rt is None:  # no gradhub runtime: plain shares, nothing to survive
            for chunk in chunks:
                if len(chunk) >= world:
                    yield split_batch(chunk, world)[rank].tolist()
            return
        if not rt.survive:
            for cursor, chunk in enumerate(chunks):
                if len(chunk) >= world:
                    mine = split_batch(chunk, world)[rank].tolist()
                    rt.batches.append(BatchShare(0, cursor, len(mine), len(chunk)))
                    yield mine
            return
        first = self.epoch * len(chunks)  # steps committed before this epoch
        if not 0 <= rt.committed_steps - first < len(chunks):
            raise MisuseError(
                f"GlobalBatchSampler at epoch {self.epoch} of a surviving job that has "
                f"committed {rt.committed_steps} steps ({len(chunks)} an epoch): its "
                "position is the steps committed, so the loop must be in epoch "
                f"{rt.committed_steps // len(chunks)}\n- help: call sampler.set_epoch(epoch) "
                "before each epoch, and start a replacement's loop at "
                "runtime.committed_steps // len(sampler)"
            )
        generation, cursor = rt.generation, 0
        handed: list[BatchShare] = []
        while True:
            if rt.generation != generation:  # a regroup: from the first step not committed
                generation, cursor = rt.generation, rt.committed_steps - first
            done = rt.committed_steps - first >= len(chunks)
            if done or not _usable(chunks, cursor, rt.world_size):
                if done or not any(s in rt.batches for s in handed):
                    return
                yield self._hand(rt, handed, BatchShare(generation, None, 1, 1), [_first(chunks)])
                continue
            chunk = chunks[cursor]
            mine = split_batch(chunk, rt.world_size)[rt.rank].tolist()
            share = BatchShare(generation, first + cursor, len(mine), len(chunk))
            cursor += 1
            yield self._hand(rt, handed, share, mine)

    @staticmethod
    def _hand(rt: Runtime, handed: list[BatchShare], share: BatchShare, index: Any) -> Any:
        rt.batches.append(share)
        handed.append(share)
        return index

    def __repr__(self) -> str:
        return (
            f"GlobalBatchSampler(samples={self.size}, global_batch_size="
            f"{self.global_batch_size}, shuffle={self.shuffle}, seed={self.seed}, "
            f"epoch={self.epoch})"
        )


def _usable(chunks: list[torch.Tensor], cursor: int, world: int) -> bool:
    """Whether global batch ``cursor`` exists and gives every rank a sample."""
    return cursor < len(chunks) and len(chunks[cursor]) >= world


def _first(chunks: list[torch.Tensor]) -> int:
    return int(chunks[0][0])
