"""c10d's errors as gradhub's: the one place they are read and translated.

``torch.distributed`` raises :class:`RuntimeError` subclasses (``DistError``;
``DistNetworkError`` when a store's host or a peer's connection is gone,
``DistStoreError`` when a store's wait runs out of time), and its class does
not always say what happened (gloo raises one ``DistError`` for a timeout and
for a lost peer); the message does. The mapping:

- **Joining a job** (a store, a process group's rendezvous): whatever failed,
  the process could not join: :class:`~gradhub.errors.RendezvousError`
  (:func:`rendezvous_error`).
- **An operation with peers or a store**: a timeout is a
  :class:`~gradhub.errors.CollectiveTimeoutError` naming the ranks waited
  on; anything else is a peer or store that is gone, a
  :class:`~gradhub.errors.WorkerFailedError` (:func:`translate`).

A message keeps the first line of c10d's (the rest is its C++ stack, kept
on the cause: every caller raises ``... from exc``). The collectives'
:meth:`~gradhub.transports.group.CollectiveGroup.failure` builds on
:func:`translate`: it first asks the store which ranks to name.
"""

from __future__ import annotations

from collections.abc import Iterable

from gradhub.errors import CollectiveTimeoutError, RendezvousError, WorkerFailedError

RESTART = "restart the job (it resumes from the last checkpoint)"
"""The usual end of a lost peer's ``- help:`` line."""


def is_timeout(exc: BaseException) -> bool:
    """Whether c10d's ``exc`` says it ran out of time (gloo's ``Timed out ...``,
    a store's ``wait timeout after ...``), as opposed to a connection lost."""
    text = str(exc).lower()
    return "timed out" in text or "timeout" in text


def first_line(exc: BaseException) -> str:
    """The first line of c10d's message, or the class's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def ranks_named(ranks: Iterable[int]) -> str:
    """``rank(s) 1, 2`` (as a timeout names them), or ``a peer`` when none is known."""
    known = sorted(set(ranks))
    return "rank(s) " + ", ".join(map(str, known)) if known else "a peer"


def translate(
    exc: BaseException,
    *,
    what: str,
    timeout: float,
    ranks: Iterable[int] = (),
    lost: str | None = None,
    detail: str | None = None,
    help: str | None = None,
) -> CollectiveTimeoutError | WorkerFailedError:
    """c10d's ``exc``, raised during ``what`` (the operation, the calling rank
    in front: ``"[rank 0] recv"``), as gradhub's error.

    ``ranks``: the ranks it waited on. A timeout names them in a
    :class:`CollectiveTimeoutError` with ``detail`` (default: c10d's first
    line). Anything else is a :class:`WorkerFailedError`:
    ``"{what}: {lost} ({c10d's first line})"``, where ``lost`` says who is
    gone (default: ``"rank(s) 1 died or left the job"``; a site that waited on a store
    names the store and its host), followed by ``- help: {help}`` (default:
    check the log of the ranks, restart the job).
    """
    waited = sorted(set(ranks))
    text = first_line(exc)
    if is_timeout(exc):
        return CollectiveTimeoutError(what, waited, timeout, detail or text)
    who = ranks_named(waited)
    lost = lost or f"{who} died or left the job"
    help = help or f"check the log of {who}; {RESTART}"
    return WorkerFailedError(f"{what}: {lost} ({text})\n- help: {help}")


def rendezvous_error(
    exc: BaseException, *, what: str, timeout: float, help: str
) -> RendezvousError:
    """c10d's ``exc`` while joining a job, whatever it was (a store or a peer
    that never came, or one that came and left: the job did not form), as
    :class:`RendezvousError`: ``"{what} within {timeout}s: {c10d's first line}"``
    (``what``: what did not happen, the rank in front where one is known),
    then ``- help: {help}``."""
    return RendezvousError(f"{what} within {timeout:g}s: {first_line(exc)}\n- help: {help}")
