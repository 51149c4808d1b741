"""A key's optimizer state on the wire, and across the slices of a sliced key.

The state of one key's server-side optimizer is what ``torch.optim`` keeps for
one parameter (``optimizer.state[param]``): for Adam ``step``, ``exp_avg``
and ``exp_avg_sq``; for SGD with momentum ``momentum_buffer``. It travels in
one message (``Op.STATE`` reply, ``Op.SET_STATE`` request):

- the payload is one ``uint8`` tensor, the bytes of every tensor entry back
  to back;
- the meta frame is ``{"state": {name: entry}}``, an entry being
  ``{"dtype": code, "shape": [...], "offset": n}`` for a tensor (``code``: the
  protocol's dtype code, ``offset`` into the payload) or ``{"value": v}``
  for anything JSON holds (a number, ``None``, a bool).

:func:`unpack` checks every entry against the payload and raises only
:class:`~gradhub.errors.ProtocolError`; the tensors it returns are copies
(never views of a network buffer).

A key sliced over several servers has one optimizer per slice: the client
joins and cuts their states (:mod:`gradhub.ps.client.optim_slices`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from gradhub.errors import ProtocolError, WrongTypeError
from gradhub.ps.wire.protocol import dtype_code, dtype_of

State = dict[str, Any]
"""One parameter's optimizer state: names to tensors or plain values."""


def pack(state: Mapping[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
    """``(meta, payload)`` of ``state``: JSON-ready entries and the tensors' bytes."""
    entries: dict[str, Any] = {}
    chunks: list[torch.Tensor] = []
    offset = 0
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu").contiguous()
            raw = (
                t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            )
            entries[name] = {"dtype": dtype_code(t.dtype), "shape": list(t.shape), "offset": offset}
            chunks.append(raw)
            offset += raw.numel()
        elif value is None or isinstance(value, bool | int | float):
            entries[name] = {"value": value}
        else:
            raise WrongTypeError(
                f"optimizer state entry {name!r} is a {type(value).__name__}; only tensors, "
                "numbers, bools and None can be sent to a parameter server"
            )
    payload = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
    return {"state": entries}, payload


def unpack(meta: Mapping[str, Any], payload: torch.Tensor) -> State:
    """The state ``pack`` described: copies of the tensors, checked against ``payload``."""
    entries = meta.get("state")
    if not isinstance(entries, dict):
        raise ProtocolError("optimizer state message without a 'state' object in its meta")
    raw = payload.reshape(-1).view(torch.uint8) if payload.numel() else payload.to(torch.uint8)
    out: State = {}
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise ProtocolError(f"optimizer state entry {name!r} is not an object")
        if "value" in entry:
            value = entry["value"]
            if not (value is None or isinstance(value, bool | int | float)):
                raise ProtocolError(f"optimizer state entry {name!r} holds {value!r}")
            out[name] = value
            continue
        try:
            dtype = dtype_of(int(entry["dtype"]))
            shape = [int(d) for d in entry["shape"]]
            start = int(entry["offset"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ProtocolError(f"optimizer state entry {name!r} is malformed: {exc}") from None
        if any(d < 0 for d in shape) or start < 0:
            raise ProtocolError(f"optimizer state entry {name!r} has a negative size or offset")
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if start + nbytes > raw.numel():
            raise ProtocolError(
                f"optimizer state entry {name!r} needs bytes [{start}, {start + nbytes}) "
                f"of a payload of {raw.numel()}"
            )
        out[name] = raw[start : start + nbytes].clone().view(dtype).view(shape)
    return out
