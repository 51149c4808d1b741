"""What a client asks of every server, not of a key: each one's counters
(:meth:`ServerRequests.stats`), a surviving job's membership
(:meth:`ServerRequests.set_members`), shutting them down. A
:class:`~gradhub.ps.client.remote.RemoteParameterServer` owns one, given its
servers' addresses and its channel's ``submit``; the client's public methods of
the same names say what each request does."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from gradhub.ps.client.link import Request
from gradhub.ps.client.payloads import meta_json
from gradhub.ps.wire.protocol import Message, Op


class ServerRequests:
    """One request to each server of ``addresses`` (server ``i`` is ``addresses[i]``),
    queued through ``submit``; each method blocks until every server answered."""

    def __init__(self, addresses: Sequence[str], submit: Callable[[Request], Future[None]]) -> None:
        self._servers = range(len(addresses))
        self._submit = submit

    def stats(self) -> list[dict[str, Any]]:
        """Each server's counters and accounting, in the order of the addresses."""
        out: list[dict[str, Any]] = []
        for i in self._servers:
            box: list[dict[str, Any]] = []

            def keep(msg: Message, box: list[dict[str, Any]] = box) -> None:
                box.append(json.loads(msg.text()))

            self._submit(Request(Op.STATS, i, on_reply=keep)).result()
            out.append(box[0])
        return out

    def set_members(self, members: Sequence[int], generation: int) -> None:
        """Send every server the membership ``generation``: the worker ids ``members``."""
        meta = meta_json({"members": [int(m) for m in members], "generation": int(generation)})
        self._to_every_server(Op.MEMBERS, meta)

    def shutdown_servers(self) -> None:
        """Ask every server to checkpoint and exit."""
        self._to_every_server(Op.SHUTDOWN)

    def _to_every_server(self, op: Op, meta: bytes = b"") -> None:
        futures = [self._submit(Request(op, i, meta=meta)) for i in self._servers]
        for f in futures:
            f.result()
