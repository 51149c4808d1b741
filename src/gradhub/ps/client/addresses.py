"""Where a client finds its parameter servers: the address forms it accepts.

A parameter server is named by a ZeroMQ endpoint. Decision: only the forms a
client can connect to are accepted (``tcp://HOST:PORT`` with a host name, an
IPv4 address or a bracketed IPv6 address, ``ipc://PATH``, ``inproc://NAME``);
anything else is refused before a socket exists, with the forms listed, since
ZeroMQ itself would accept some typos and wait forever on them.

The addresses a job's servers published in the launcher's store are read by
the ``ps-*`` strategies (:mod:`gradhub.train.strategies.ps`), which hand them
to :class:`~gradhub.ps.client.remote.RemoteParameterServer`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from gradhub.errors import InvalidOptionError

__all__ = ["ADDRESSES_KEY", "address_list", "check_address"]

ADDRESSES_KEY = "gradhub/ps/addresses"
"""The key of the launcher's c10d store under which the job's servers' addresses
are published (a JSON list): written by :mod:`gradhub.cli.launcher`, read by the
``ps-*`` strategies."""

_ADDRESS = re.compile(r"tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):[0-9]{1,5}|ipc://\S+|inproc://\S+")


def check_address(address: object) -> str:
    """``address`` if it is a ZeroMQ endpoint a client can connect to, else
    :class:`~gradhub.errors.InvalidOptionError`."""
    if not isinstance(address, str) or _ADDRESS.fullmatch(address) is None:
        raise InvalidOptionError(
            f"parameter-server address {address!r} is not one of the accepted forms: "
            "tcp://HOST:PORT (e.g. tcp://127.0.0.1:5555 or tcp://[::1]:5555), "
            "ipc:///path/to/socket, inproc://name"
        )
    return address


def address_list(addresses: str | Sequence[str]) -> list[str]:
    """One address or several as a checked, non-empty list."""
    addrs = [addresses] if isinstance(addresses, str) else list(addresses)
    if not addrs:
        raise InvalidOptionError("give at least one parameter-server address")
    return [check_address(a) for a in addrs]
