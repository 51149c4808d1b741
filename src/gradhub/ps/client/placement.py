"""Where a key lives: which server, and how a large tensor is sliced (pure functions).

- A key lives on server ``crc32(key) % num_servers``: stable across processes
  and runs.
- A tensor larger than ``slice_bytes`` is cut into ``num_servers`` slices
  (BigDL's partition math on the flattened tensor); slice ``i`` lives on
  server ``(home + i) % num_servers`` under the key ``"<key>[slice i/n]"``.

The layout depends only on the key, the tensor's byte size, the number of
servers and ``slice_bytes``: every worker must list the same servers in the
same order and use the same threshold.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from gradhub.partition import partition_ranges

DEFAULT_SLICE_BYTES = 4 << 20


def server_index(key: str, num_servers: int) -> int:
    """The server that holds ``key`` (stable across processes and runs)."""
    if num_servers == 1:
        return 0
    return zlib.crc32(key.encode("utf-8")) % num_servers


@dataclass(frozen=True)
class Piece:
    """One stored part of a key: its key on the wire, its server, its elements."""

    key: str
    server: int
    span: slice | None  # None: the whole tensor


def layout(key: str, nbytes: int, numel: int, num_servers: int, slice_bytes: int) -> list[Piece]:
    """The pieces of a tensor of ``nbytes`` bytes and ``numel`` elements stored under ``key``."""
    home = server_index(key, num_servers)
    if num_servers == 1 or nbytes <= slice_bytes or numel < num_servers:
        return [Piece(key, home, None)]
    return [
        Piece(f"{key}[slice {i}/{num_servers}]", (home + i) % num_servers, slice(s, s + n))
        for i, (s, n) in enumerate(partition_ranges(numel, num_servers))
    ]


def split(
    key: str, tensor: torch.Tensor, num_servers: int, slice_bytes: int
) -> list[tuple[Piece, torch.Tensor]]:
    """The pieces of ``tensor`` with their parts (views, no copies)."""
    pieces = layout(
        key, tensor.numel() * tensor.element_size(), tensor.numel(), num_servers, slice_bytes
    )
    if pieces[0].span is None:
        return [(pieces[0], tensor)]
    flat = tensor.reshape(-1)
    return [(p, flat[p.span]) for p in pieces]
