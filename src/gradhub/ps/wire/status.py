"""One table between reply statuses and exceptions, used by both ends.

The server answers a failed request with :func:`status_of` its exception and
the exception's message; the client raises :func:`error_of` that status, an
instance of the same class with the same message and the server's address.
A subclass comes before its base in ``TABLE`` (the first match wins).
``BAD_REQUEST`` (a ``ProtocolError``, any other ``ValueError`` or ``TypeError``:
a request the server refused, e.g. hyperparameters its optimizer does not
have) comes back as an :class:`~gradhub.errors.InvalidOptionError`, a ``ValueError``.
"""

from __future__ import annotations

from gradhub.errors import (
    AuthenticationError,
    ClosedError,
    DtypeMismatchError,
    DuplicateParameterError,
    GradhubError,
    GradhubTimeoutError,
    InvalidOptionError,
    NonFiniteError,
    OptimizerMismatchError,
    ProtocolError,
    ServerTimeoutError,
    ShapeMismatchError,
    UnknownParameterError,
)
from gradhub.ps.wire.protocol import Status

TABLE: tuple[tuple[Status, type[Exception]], ...] = (
    (Status.UNKNOWN_KEY, UnknownParameterError),
    (Status.DUPLICATE_KEY, DuplicateParameterError),
    (Status.DTYPE_MISMATCH, DtypeMismatchError),
    (Status.SHAPE_MISMATCH, ShapeMismatchError),
    (Status.OPTIMIZER_MISMATCH, OptimizerMismatchError),
    (Status.NON_FINITE, NonFiniteError),
    (Status.REFUSED, AuthenticationError),
    (Status.SHUTTING_DOWN, ClosedError),
    (Status.TIMEOUT, ServerTimeoutError),
    (Status.TIMEOUT, GradhubTimeoutError),
    (Status.BAD_REQUEST, ProtocolError),
    (Status.BAD_REQUEST, ValueError),
    (Status.BAD_REQUEST, TypeError),
)
_CLASS = {status: cls for status, cls in reversed(TABLE)}  # first entry per status wins


def status_of(exc: BaseException) -> Status:
    """The reply status for ``exc`` (``INTERNAL`` for anything unexpected)."""
    for status, cls in TABLE:
        if isinstance(exc, cls):
            return status
    return Status.INTERNAL


def error_of(status: Status, text: str, server: str, operation: str, key: str) -> Exception:
    """The exception a client raises for an error reply from ``server``."""
    message = f"{text} (server {server})"
    if status == Status.BAD_REQUEST:
        return InvalidOptionError(message)
    cls = _CLASS.get(status)
    if cls is None:
        return GradhubError(f"{operation} of {key!r} failed on {server}: {text}")
    exc = cls.__new__(cls)  # the server's message as is, whatever the class's __init__ takes
    exc.args = (message,)
    if isinstance(exc, ServerTimeoutError):
        exc.server, exc.key, exc.operation = server, key or None, operation
    return exc
