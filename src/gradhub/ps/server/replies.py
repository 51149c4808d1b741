"""How a :class:`~gradhub.ps.server.service.Service` answers a request: through a
:class:`Reply` (the server's I/O), or :func:`no_reply` for requests replayed
from the log."""

from __future__ import annotations

from typing import Protocol

import torch

from gradhub.ps.wire.protocol import Message, Status


class Reply(Protocol):
    """How a service's answer leaves: the server's reply to ``msg``."""

    def __call__(
        self,
        msg: Message,
        status: Status = Status.OK,
        payload: torch.Tensor | bytes | None = None,
        *,
        aux: int = 0,
        meta: bytes = b"",
    ) -> None: ...


def no_reply(
    msg: Message,
    status: Status = Status.OK,
    payload: torch.Tensor | bytes | None = None,
    *,
    aux: int = 0,
    meta: bytes = b"",
) -> None:
    """The replies to requests replayed from the log: answered before, by the
    process that logged them."""
