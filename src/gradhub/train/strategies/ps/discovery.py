"""Where the parameter servers are, and the settings of the ``ps-*`` strategies.

Decisions:
- ``servers=[...]`` (addresses, e.g. ``"tcp://10.0.0.5:5555"``) wins; without
  it the strategy reads the addresses ``gradhub run --servers S`` published
  in the launcher's c10d store under :data:`ADDRESSES_KEY` (a JSON list).
- A store that does not answer at ``MASTER_ADDR:MASTER_PORT`` is a
  :class:`~gradhub.errors.RendezvousError` naming that address (not torch's
  ``DistNetworkError``); a store that answers but holds no addresses means
  "none published" (``None``), which the strategy turns into an error saying
  how to give servers; a published value that is not a JSON list of strings
  is a :class:`~gradhub.errors.LaunchEnvironmentError` naming the key.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from gradhub import codecs
from gradhub.errors import InvalidOptionError, LaunchEnvironmentError
from gradhub.ps.client.addresses import ADDRESSES_KEY
from gradhub.transports.c10d_errors import rendezvous_error

"""Key in the launcher's c10d store under which ``gradhub run --servers`` puts
the parameter-server addresses (a JSON list of ZeroMQ endpoints)."""


@dataclass(kw_only=True)
class PSConfig:
    """Settings of the parameter-server strategies."""

    servers: list[str] | None = None
    """Server addresses; ``None`` reads those ``gradhub run --servers`` published."""
    secret: str | bytes | None = None
    """Shared secret when the servers require one."""
    timeout: float = 60.0
    """Seconds a push or pull may take (ssp/sync waits included) before an error."""
    compress: str = "none"
    """Wire codec for gradients (``"none"``, ``"fp16"``, ``"bf16"``, ...)."""

    def __post_init__(self) -> None:
        if isinstance(self.servers, str):
            self.servers = [self.servers]
        if self.servers is not None and not self.servers:
            raise InvalidOptionError("servers is an empty list; give at least one address or None")
        if not self.timeout > 0:
            raise InvalidOptionError(f"timeout must be > 0 seconds, got {self.timeout}")
        codecs.check(self.compress, for_="ps-async/ps-sync/ps-ssp")


def published_addresses(timeout: float = 10.0) -> list[str] | None:
    """The addresses ``gradhub run --servers`` published, or ``None`` if there are none.

    Reads the launcher's store at ``MASTER_ADDR:MASTER_PORT`` (torchrun's
    standard environment), waiting at most ``timeout`` seconds for it.
    """
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    where = f"the launcher's store at {host}:{port}"
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout))
    except (RuntimeError, ValueError) as exc:  # DistNetworkError; a port that is no number
        raise rendezvous_error(
            exc,
            what=f"looking for the parameter-server addresses, {where} did not answer",
            timeout=timeout,
            help="check MASTER_ADDR/MASTER_PORT, or pass servers=['tcp://HOST:PORT', ...]",
        ) from exc
    try:
        store.wait([ADDRESSES_KEY], timedelta(seconds=timeout))
    except RuntimeError:  # c10d's DistStoreError: the wait timed out
        return None  # the store answers and holds none: no servers were published
    try:
        raw = store.get(ADDRESSES_KEY)
        addresses = json.loads(raw)
    except (RuntimeError, ValueError) as exc:
        raise LaunchEnvironmentError(
            f"{where}: {ADDRESSES_KEY!r} could not be read as a JSON list ({exc})\n"
            "- help: start the job with `gradhub run --servers S`, which writes it"
        ) from exc
    if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
        raise LaunchEnvironmentError(
            f"{where}: {ADDRESSES_KEY!r} holds {addresses!r}, not a list of addresses\n"
            "- help: start the job with `gradhub run --servers S`, which writes it"
        )
    return addresses
