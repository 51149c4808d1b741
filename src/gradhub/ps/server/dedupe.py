"""Exactly-once bookkeeping: which (worker, session, sequence) a server has applied.

Every mutating request (init, push) of a client carries its worker id, a
random session id (one per client object, so a restarted worker process does
not collide with its predecessor) and a sequence number that starts at 1 and
grows by one per request sent to that server. Requests may arrive out of order
(priorities reorder them), so per session we keep a *low watermark* (every
sequence number up to it was applied) and the set of applied numbers above
it, which stays small.

A retried request whose number was applied is acknowledged again without
being applied again. A request refused (bad shape, unknown key, ...) is
*settled* too, so the watermark passes it, but not applied: a retry of it is
checked and refused again. The ledger is part of a server checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Session:
    session: int
    low: int = 0
    above: set[int] = field(default_factory=set)
    refused: set[int] = field(default_factory=set)

    def applied(self, seq: int) -> bool:
        return (seq <= self.low or seq in self.above) and seq not in self.refused

    def mark(self, seq: int, *, refused: bool = False) -> None:
        if seq == self.low + 1 and not self.above and not refused:
            self.low = seq  # the next one, nothing above: most requests
            return
        if seq <= self.low or seq in self.above:
            return
        if refused:
            self.refused.add(seq)
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

    def mark(self, worker: int, session: int, seq: int, *, refused: bool = False) -> None:
        """Record ``seq`` as applied (or ``refused``: settled, not applied)."""
        self._get(worker, session).mark(seq, refused=refused)

    def low(self, worker: int, session: int) -> int:
        """Every sequence number up to this one was applied (0: none known)."""
        s = self._sessions.get(worker)
        return s.low if s is not None and s.session == session else 0

    def lows(self) -> dict[int, tuple[int, int]]:
        return {w: (s.session, s.low) for w, s in self._sessions.items()}

    def state_dict(self) -> dict[int, Any]:
        return {
            w: (s.session, s.low, sorted(s.above), sorted(s.refused))
            for w, s in self._sessions.items()
        }

    def load_state_dict(self, state: dict[Any, Any]) -> None:
        self._sessions = {
            int(w): _Session(
                int(v[0]),
                int(v[1]),
                {int(x) for x in v[2]},
                {int(x) for x in v[3]} if len(v) > 3 else set(),
            )
            for w, v in state.items()
        }
