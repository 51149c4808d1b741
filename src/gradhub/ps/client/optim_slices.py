"""A sliced key's optimizer state: put together from its slices, cut into them.

A key sliced over several servers (:mod:`gradhub.ps.client.placement`) has one
optimizer per slice. :func:`join` puts the slices' states together into the
state of the whole key (tensors shaped like the key, scalars such as Adam's
``step`` taken from the first slice: every slice took the same pushes);
:func:`cut` is the inverse, for sending a state to the slices. Each slice's
state travels as :mod:`gradhub.ps.wire.optim_state` says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gradhub.errors import ShapeMismatchError
from gradhub.ps.client.placement import Piece
from gradhub.ps.wire.optim_state import State

__all__ = ["cut", "join"]


def join(key: str, parts: Sequence[State], pieces: Sequence[Piece], like: torch.Tensor) -> State:
    """The state of the whole key from its slices' states (in ``pieces`` order)."""
    if len(parts) == 1 and pieces[0].span is None:
        return parts[0]
    names = set(parts[0])
    if any(set(p) != names for p in parts):
        raise ShapeMismatchError(
            f"[{key!r}] optimizer state",
            sorted(names),
            [sorted(p) for p in parts],
            "entries",
        )
    out: State = {}
    for name, first in parts[0].items():
        if isinstance(first, torch.Tensor) and first.dim() > 0:
            out[name] = torch.cat([p[name].reshape(-1) for p in parts]).view(like.shape)
        else:
            out[name] = first
    return out


def cut(
    key: str, state: Mapping[str, Any], pieces: Sequence[Piece], like: torch.Tensor
) -> list[State]:
    """Each slice's part of the whole key's ``state`` (in ``pieces`` order)."""
    for name, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != like.shape:
            raise ShapeMismatchError(
                f"[{key!r}][{name!r}]", list(like.shape), list(value.shape), "shape"
            )
    if len(pieces) == 1 and pieces[0].span is None:
        return [dict(state)]
    return [
        {
            name: value.reshape(-1)[piece.span]
            if isinstance(value, torch.Tensor) and value.dim() > 0
            else value
            for name, value in state.items()
        }
        for piece in pieces
    ]
