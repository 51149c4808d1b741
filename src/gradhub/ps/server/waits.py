"""Requests a server holds until it can answer them, each with a deadline.

Two kinds wait (one :class:`Waits` each): pulls waiting for a sync round or for
slow workers (ssp), and pushes or pulls of a key whose ``init`` has not arrived
yet (a worker may start before the one that initialises). A client tells the
server its timeout in the request header (``aux``, milliseconds); the server
answers a request that is still waiting shortly before it (:func:`answer_by`)
with an error that names the cause (the workers a round waits for, the key
that was never initialised), so that the answer reaches the client before its
own deadline.

A retry of a held request (same connection and request id) is not held twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gradhub.ps.wire.protocol import Message

DEFAULT_WAIT = 60.0
"""Seconds a request that names no timeout may wait."""


def client_timeout(msg: Message) -> float:
    """The timeout the client gave with ``msg`` (seconds)."""
    return msg.header.aux / 1000 if msg.header.aux else DEFAULT_WAIT


def answer_by(msg: Message, now: float) -> float:
    """When the server answers ``msg`` if it is still waiting: a margin (a quarter
    of the timeout, at most half a second) before the client's own deadline."""
    timeout = client_timeout(msg)
    return now + timeout - min(0.5, timeout / 4)


@dataclass
class _Held:
    msg: Message
    deadline: float


class Waits:
    """Held requests by key, first held first out."""

    def __init__(self) -> None:
        self._by_key: dict[str, list[_Held]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._by_key.values())

    def __bool__(self) -> bool:  # asked on every pass of the server's loop: no count
        return bool(self._by_key)  # its lists are never empty (hold, release, expired)

    def held_keys(self) -> list[str]:
        return list(self._by_key)

    def hold(self, key: str, msg: Message, now: float) -> bool:
        """Hold ``msg`` under ``key``; False if it is a retry of one held already."""
        held = self._by_key.setdefault(key, [])
        rid = (msg.routing, msg.header.request_id)
        if any((h.msg.routing, h.msg.header.request_id) == rid for h in held):
            return False
        held.append(_Held(msg, answer_by(msg, now)))
        return True

    def release(
        self, key: str, ready: Callable[[Message], bool] = lambda _msg: True
    ) -> list[Message]:
        """Remove and return the requests held under ``key`` that are ``ready``, in
        the order they came; the others stay held with their deadlines."""
        out: list[Message] = []
        keep: list[_Held] = []
        for h in self._by_key.pop(key, []):
            if ready(h.msg):
                out.append(h.msg)
            else:
                keep.append(h)
        if keep:
            self._by_key[key] = keep
        return out

    def expired(self, now: float) -> Iterator[tuple[str, Message]]:
        """Remove and yield the requests whose deadline has passed."""
        for key in list(self._by_key):
            held = self._by_key[key]
            keep = [h for h in held if h.deadline > now]
            for h in held:
                if h.deadline <= now:
                    yield key, h.msg
            if keep:
                self._by_key[key] = keep
            else:
                del self._by_key[key]
