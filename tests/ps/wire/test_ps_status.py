"""Reply statuses <-> errors (ps/wire/status.py): what a server raises comes back
on the client as the same class, or, for a refused request (``BAD_REQUEST``), as an
``InvalidOptionError`` that a caller's ``except ValueError`` still catches."""

from __future__ import annotations

import pytest

from gradhub.errors import (
    DuplicateParameterError,
    InvalidOptionError,
    NonFiniteError,
    ProtocolError,
    ShapeMismatchError,
    UnknownParameterError,
    WrongTypeError,
)
from gradhub.ps.wire import status
from gradhub.ps.wire.protocol import Status


@pytest.mark.parametrize(
    "exc",
    [
        InvalidOptionError("SGD of 'w' has no hyperparameter(s) bogus; it has lr"),
        WrongTypeError("parameter keys are non-empty strings, got ''"),
        ProtocolError("optimizer state message without a 'state' object in its meta"),
        ValueError("a ValueError from torch"),
        TypeError("a TypeError from torch"),
    ],
)
def test_a_refused_request_comes_back_as_an_invalid_option_error(exc: Exception) -> None:
    code = status.status_of(exc)
    assert code == Status.BAD_REQUEST
    back = status.error_of(code, str(exc), "tcp://127.0.0.1:5555", "push", "w")
    assert type(back) is InvalidOptionError and isinstance(back, ValueError)
    assert str(back) == f"{exc} (server tcp://127.0.0.1:5555)"


@pytest.mark.parametrize(
    "exc",
    [
        UnknownParameterError("unknown parameter key 'w'"),
        DuplicateParameterError("parameter 'w' is already initialised"),
        ShapeMismatchError("['w']", [2], [3]),
        NonFiniteError("the push of 'w' holds NaN or infinity"),
    ],
)
def test_a_mapped_error_comes_back_as_its_own_class(exc: Exception) -> None:
    back = status.error_of(status.status_of(exc), str(exc), "tcp://h:1", "push", "w")
    assert type(back) is type(exc) and str(back) == f"{exc} (server tcp://h:1)"
