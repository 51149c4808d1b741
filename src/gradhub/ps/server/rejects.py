"""What a server does with a message it cannot accept: count it, and refuse a hello
that fails authentication so the client learns why at once.

Malformed, oversized and unknown-op messages are dropped and counted, never
answered. A *hello* that fails authentication (wrong secret, no secret, or a
secret sent to a server without one) is answered with a fixed, unsigned
``REFUSED`` reply (the server shares no key with that peer, so it cannot sign
it; the client trusts it only as the answer to its own pending hello), at most
:data:`REFUSALS_PER_SECOND` a second. The refused peers are logged at most
once every :data:`LOG_EVERY` seconds, with how many refusals that covers.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from gradhub.errors import AuthenticationError, OversizedError, ProtocolError, UnknownOpError
from gradhub.ps.wire import protocol
from gradhub.ps.wire.protocol import Op, Status

log = logging.getLogger(__name__)

REFUSALS_PER_SECOND = 20.0
LOG_EVERY = 10.0


def _peer(frames: list[Any]) -> str:
    try:
        return str(frames[1].get("Peer-Address"))  # the sender's IP (a zmq.Frame property)
    except (AttributeError, IndexError, OSError, ValueError):
        return "an unknown peer"


class Rejects:
    """Counts of dropped messages and the rate-limited refusals of unauthenticated hellos."""

    def __init__(
        self, counters: dict[str, int], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.counters = counters
        for kind in ("malformed", "unauthenticated", "oversized", "unknown_op", "refused"):
            counters.setdefault(f"dropped_{kind}" if kind != "refused" else "refused", 0)
        self._clock = clock
        self._tokens = REFUSALS_PER_SECOND
        self._last_fill = clock()
        self._last_log = -math.inf  # the first refused peer is logged at once
        self._unlogged: dict[str, int] = {}

    def reject(self, frames: list[Any], exc: ProtocolError) -> list[Any] | None:
        """Count the message; the frames of a refusal to send back, or ``None``."""
        if isinstance(exc, AuthenticationError):
            kind = "dropped_unauthenticated"
        elif isinstance(exc, OversizedError):
            kind = "dropped_oversized"
        elif isinstance(exc, UnknownOpError):
            kind = "dropped_unknown_op"
        else:
            kind = "dropped_malformed"
        self.counters[kind] += 1
        log.debug("dropped a message: %s", exc)
        if not isinstance(exc, AuthenticationError):
            return None
        header = protocol.peek_header(frames[1:])
        if header is None or header.op != Op.HELLO or header.is_reply:
            return None
        peer = _peer(frames)
        self._unlogged[peer] = self._unlogged.get(peer, 0) + 1
        now = self._clock()
        if now - self._last_log >= LOG_EVERY:
            self._last_log = now
            peers = ", ".join(f"{p} ({n}x)" for p, n in sorted(self._unlogged.items()))
            log.warning("refused unauthenticated hello(s) from %s: %s", peers, exc)
            self._unlogged.clear()
        self._tokens = min(
            REFUSALS_PER_SECOND, self._tokens + (now - self._last_fill) * REFUSALS_PER_SECOND
        )
        self._last_fill = now
        if self._tokens < 1:
            return None
        self._tokens -= 1
        self.counters["refused"] += 1
        reply = protocol.reply(header, incarnation=0, status=Status.REFUSED)
        return [frames[0], *protocol.encode(reply, "", b"refused")]
