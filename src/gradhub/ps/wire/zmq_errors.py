"""ZeroMQ's errors as gradhub's: the one place the parameter server's code turns a
``zmq.ZMQError`` it raises to a caller into a :mod:`gradhub.errors` class.

Both sides raise through it (``raise translate(exc, ...) from exc``): a server
whose socket cannot bind, a client whose socket cannot connect. A failed send
is not raised: the peer went away, and the request's retry (or the client's,
to a server) finds it again; the code that sends logs it and goes on.
"""

from __future__ import annotations

from typing import Literal

import zmq

from gradhub.errors import BindError, GradhubError, InvalidOptionError

__all__ = ["translate"]


def translate(
    exc: zmq.ZMQError, *, endpoint: str, action: Literal["bind", "connect"]
) -> GradhubError:
    """The gradhub error for ``exc``, raised by ZeroMQ on ``action`` of a
    parameter-server socket to ``endpoint``: :class:`~gradhub.errors.BindError` (an
    ``OSError``: the address is in use, or not one of this host's) for a bind,
    :class:`~gradhub.errors.InvalidOptionError` (a ``ValueError``: an address
    ZeroMQ refuses, such as an ``ipc://`` path too long) for a connect."""
    if action == "bind":
        return BindError(f"cannot bind parameter server to {endpoint}: {exc}")
    return InvalidOptionError(f"cannot connect to parameter server {endpoint!r}: {exc}")
