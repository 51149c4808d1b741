"""What a client asks of every server, not of a key: each one's counters
(:meth:`ServerRequests.stats`), a surviving job's membership
(:meth:`ServerRequests.set_members`), shutting them down. A base of
:class:`~gradhub.ps.client.remote.RemoteParameterServer`."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from gradhub.ps.client.payloads import meta_json
from gradhub.ps.wire.protocol import Message, Op


class ServerRequests:
    """Requests to every server of :attr:`addresses`, through the client's ``_submit``."""

    addresses: list[str]

    def _check_open(self) -> None:
        raise NotImplementedError

    def _submit(
        self,
        op: Op,
        user_key: str,
        key: str,
        server: int,
        priority: int = 0,
        *,
        meta: bytes = b"",
        on_reply: Callable[[Message], None] | None = None,
    ) -> Future[None]:
        raise NotImplementedError

    def stats(self) -> list[dict[str, Any]]:
        """Each server's counters and accounting (blocks up to ``timeout``)."""
        self._check_open()
        out: list[dict[str, Any]] = []
        for i in range(len(self.addresses)):
            box: list[dict[str, Any]] = []

            def keep(msg: Message, box: list[dict[str, Any]] = box) -> None:
                box.append(json.loads(msg.text()))

            self._submit(Op.STATS, "", "", i, on_reply=keep).result()
            out.append(box[0])
        return out

    def set_members(self, members: Sequence[int], generation: int) -> None:
        """Tell every server a surviving job's membership ``generation``: the worker
        ids in ``members`` are its workers from now on. A sync round not applied
        yet is dropped (its step is pushed again), the others leave rounds and
        staleness for good, and a push tagged with an older generation is
        ignored (:mod:`gradhub.ps.server.consistency`). Blocks up to ``timeout``."""
        self._check_open()
        meta = meta_json({"members": [int(m) for m in members], "generation": int(generation)})
        futures = [
            self._submit(Op.MEMBERS, "", "", i, meta=meta) for i in range(len(self.addresses))
        ]
        for f in futures:
            f.result()

    def shutdown_servers(self) -> None:
        """Ask every server to checkpoint and exit."""
        self._check_open()
        futures = [self._submit(Op.SHUTDOWN, "", "", i) for i in range(len(self.addresses))]
        for f in futures:
            f.result()
