"""The shared arenas of a channel's links: connected from a hello reply, watched
by the channel's I/O thread, dropped when they fail.

A server on this host offers an arena in its hello reply
(:mod:`gradhub.ps.wire.arena`); :meth:`LinkArenas.start` connects it
(:meth:`~gradhub.ps.client.arena.ClientArena.connect`) and adds its Unix
connection to the I/O thread's poll. The channel hands the poll's events on
that connection back to the link they belong to (:meth:`LinkArenas.link_of`):
a cancel the server confirmed, or the connection's end.
"""

from __future__ import annotations

import contextlib
import select
from collections.abc import Callable

from gradhub.ps.client.arena import ClientArena
from gradhub.ps.client.link import Link
from gradhub.ps.client.shared_tensors import SharedTensors
from gradhub.ps.wire.protocol import Message

__all__ = ["LinkArenas"]


class LinkArenas:
    """The arenas of one channel's links (used with the channel's sockets' lock held).

    ``poll``: the I/O thread's poll, ``wake``: wakes that thread (it watches a
    new connection from its next poll); ``enabled``, ``min_bytes`` and
    ``shared``: the client's settings (``shared``: the user's tensors)."""

    def __init__(
        self,
        poll: select.poll,
        wake: Callable[[], None],
        *,
        enabled: bool,
        min_bytes: int,
        shared: SharedTensors | None,
        worker_id: int,
        session: int,
        secret: bytes | None,
        timeout: float,
    ) -> None:
        self.enabled = enabled
        self.min_bytes = min_bytes
        self.shared = shared
        self._poll = poll
        self._wake = wake
        self._worker_id = worker_id
        self._session = session
        self._secret = secret
        self._timeout = timeout
        self._links: dict[int, Link] = {}  # by the descriptor of their arena's connection

    def link_of(self, fd: int) -> Link | None:
        """The link whose arena connection ``fd`` is, if any."""
        return self._links.get(fd)

    def start(self, s: Link, msg: Message) -> None:
        """Connect the shared arena a hello reply offers, if this host is the server's."""
        self.drop(s)
        if not self.enabled:
            return
        arena = ClientArena.connect(
            msg,
            s.address,
            session=self._session,
            worker_id=self._worker_id,
            secret=self._secret,
            timeout=self._timeout,
            min_bytes=self.min_bytes,
            shared=self.shared,
        )
        if arena is None:
            return
        s.arena = arena
        self._links[arena.fileno()] = s
        self._poll.register(arena.fileno(), select.POLLIN)
        self._wake()  # the I/O thread watches it from its next poll

    def drop(self, s: Link) -> None:
        """Stop using ``s``'s shared arena (payloads take the ZeroMQ path)."""
        if s.arena is None:
            return
        fd = s.arena.fileno()
        self._links.pop(fd, None)
        with contextlib.suppress(KeyError):
            self._poll.unregister(fd)
        s.arena.close()
        s.arena = None
