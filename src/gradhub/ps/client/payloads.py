"""What a client's requests and replies carry besides the header: the meta JSON
of an ``init`` or ``push``, and a pull's reply copied into the caller's tensors
(a whole key, or one slice of a sliced key)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from gradhub.errors import (
    DtypeMismatchError,
    InvalidOptionError,
    ShapeMismatchError,
    WrongTypeError,
)
from gradhub.ps.wire.protocol import Message

__all__ = ["filler", "meta_json"]


def filler(key: str, targets: list[torch.Tensor], rng: slice | None) -> Callable[[Message], None]:
    def fill(msg: Message) -> None:
        value = msg.tensor()
        first = targets[0]
        if rng is None:
            if value.shape != first.shape:
                raise ShapeMismatchError(f"[{key!r}]", list(value.shape), list(first.shape))
            if value.dtype != first.dtype:
                raise DtypeMismatchError(f"[{key!r}]", value.dtype, first.dtype)
        elif value.numel() != rng.stop - rng.start or value.dtype != first.dtype:
            raise ShapeMismatchError(
                f"[{key!r}]", f"{value.numel()} x {value.dtype}", f"{first.numel()} x {first.dtype}"
            )
        with torch.no_grad():
            for t in targets:
                if rng is None:
                    if t.data_ptr() != value.data_ptr():  # else answered in place (arena)
                        t.copy_(value)
                elif t.is_contiguous():
                    part = t.view(-1)[rng]
                    if part.data_ptr() != value.data_ptr():
                        part.copy_(value)
                else:
                    flat = t.reshape(-1).clone()
                    flat[rng].copy_(value)
                    t.copy_(flat.view(t.shape))

    return fill


def meta_json(data: dict[str, Any]) -> bytes:
    def plain(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
        raise WrongTypeError(f"{type(value).__name__} cannot be sent to a parameter server as JSON")

    try:
        return json.dumps(data, default=plain, allow_nan=False).encode()
    except ValueError as exc:
        raise InvalidOptionError(
            f"{data}: hyperparameters must be finite numbers ({exc})"
        ) from None
