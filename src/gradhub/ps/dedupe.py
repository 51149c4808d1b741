"""Exactly-once bookkeeping: which (worker, session, sequence) a server has applied.

Every mutating request (init, push) of a client carries its worker id, a
random session id (one per client object, so a restarted worker process does
not collide with its predecessor) and a sequence number that starts at 1 and
grows by one per request sent to that server. Requests may arrive out of order
(priorities reorder them), so per session we keep a *low watermark* (every
sequence number up to it was applied) and the set of applied numbers above
it, which stays small.

A retried request whose number was applied is acknowledged again without
being applied again. The ledger is part of a server checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Session:
    session: int
    low: int = 0
    above: set[int] = field(default_factory=set)

    def applied(self, seq: int) -> bool:
        return seq <= self.low or seq in self.above

    def mark(self, seq: int) -> None:
        if seq <= self.low:
            return
        self.above.add(seq)
        while self.low + 1 in self.above:
            self.low += 1
            self.above.discard(self.low)


class Ledger:
    """Applied sequence numbers per worker; one live session per worker."""

    def __init__(self) -> None:
        self._sessions: dict[int, _Session] = {}

    def _get(self, worker: int, session: int) -> _Session:
        s = self._sessions.get(worker)
        if s is None or s.session != session:
            # A new client object for this worker: its numbering starts afresh.
            s = self._sessions[worker] = _Session(session)
        return s

    def applied(self, worker: int, session: int, seq: int) -> bool:
        s = self._sessions.get(worker)
        return s is not None and s.session == session and s.applied(seq)

    def mark(self, worker: int, session: int, seq: int) -> None:
        self._get(worker, session).mark(seq)

    def low(self, worker: int, session: int) -> int:
        """Every sequence number up to this one was applied (0: none known)."""
        s = self._sessions.get(worker)
        return s.low if s is not None and s.session == session else 0

    def lows(self) -> dict[int, tuple[int, int]]:
        return {w: (s.session, s.low) for w, s in self._sessions.items()}

    def state_dict(self) -> dict[int, Any]:
        return {w: (s.session, s.low, sorted(s.above)) for w, s in self._sessions.items()}

    def load_state_dict(self, state: dict[Any, Any]) -> None:
        self._sessions = {
            int(w): _Session(int(sess), int(low), {int(x) for x in above})
            for w, (sess, low, above) in state.items()
        }
