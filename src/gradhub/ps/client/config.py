"""ClientConfig: the settings of a :class:`~gradhub.ps.client.remote.RemoteParameterServer`.

One typed object for the client's thirteen settings, validated in one place
(``__post_init__``); ``RemoteParameterServer(addresses, worker_id=..., ...)``
maps its keywords onto it, ``RemoteParameterServer(config=...)`` takes it whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gradhub import codecs
from gradhub.errors import InvalidOptionError, WrongTypeError
from gradhub.ps.client.addresses import address_list
from gradhub.ps.client.arena import DEFAULT_MIN_BYTES
from gradhub.ps.client.placement import DEFAULT_SLICE_BYTES

__all__ = ["ClientConfig"]


@dataclass(kw_only=True)
class ClientConfig:
    """Settings of a parameter-server client
    (:class:`~gradhub.ps.client.remote.RemoteParameterServer`)."""

    addresses: str | Sequence[str]
    """One ZeroMQ endpoint or a list (``tcp://host:port``); a list after validation."""
    worker_id: int
    """This worker's id, unique in the job and in ``[0, 2**32)``; sync and ssp
    servers count workers by it."""
    secret: str | bytes | None = None
    """Shared secret (str or bytes) when the servers require one."""
    timeout: float = 60.0
    """Seconds any request may take before ``ServerTimeoutError`` (sync/ssp waits
    and waits for a key's ``init`` included)."""
    connect_timeout: float = 10.0
    """Seconds a server may take to answer the first hello before its requests
    fail with ``ServerUnavailableError`` (at most ``timeout`` is used)."""
    nonfinite: str = "error"
    """A push holding NaN or infinity is refused with ``NonFiniteError``
    (``"error"``) or dropped with a warning (``"skip"``: its future is done,
    nothing is sent)."""
    compress: str = "none"
    """Wire codec for gradients (:func:`gradhub.codecs.check`: ``"none"``,
    ``"fp16"``, ``"bf16"``, ``"bf16-truncate"``); values always travel exactly."""
    slice_bytes: int = DEFAULT_SLICE_BYTES
    """Tensors above this many bytes are sliced over all servers."""
    heartbeat_interval: float = 1.0
    """Seconds between heartbeats to each server."""
    retry_interval: float = 5.0
    """Seconds before an unanswered request is sent again."""
    max_inflight_bytes: int = 64 << 20
    """Push bytes in flight per server before further pushes queue."""
    arena: bool | None = None
    """Use a shared-memory arena with servers on this host; ``None``: yes, unless
    ``GRADHUB_PS_ARENA=0`` (:func:`gradhub.ps.wire.arena.enabled`)."""
    arena_min_bytes: int = DEFAULT_MIN_BYTES
    """Smallest payload that goes through the arena."""

    def __post_init__(self) -> None:
        self.addresses = address_list(self.addresses)
        if isinstance(self.worker_id, bool) or not isinstance(self.worker_id, int):
            raise WrongTypeError(f"worker_id must be an int, got {self.worker_id!r}")
        if not 0 <= self.worker_id < 2**32:
            raise InvalidOptionError(f"worker_id must be in [0, 2**32), got {self.worker_id}")
        if self.nonfinite not in ("error", "skip"):
            raise InvalidOptionError(f"nonfinite must be 'error' or 'skip', got {self.nonfinite!r}")
        for name in ("timeout", "connect_timeout", "heartbeat_interval", "retry_interval"):
            if not getattr(self, name) > 0:
                raise InvalidOptionError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")
        for name in ("slice_bytes", "max_inflight_bytes"):
            if not getattr(self, name) > 0:
                raise InvalidOptionError(f"{name} must be > 0 bytes, got {getattr(self, name)!r}")
        if self.arena_min_bytes < 0:
            raise InvalidOptionError(f"arena_min_bytes must be >= 0, got {self.arena_min_bytes}")
        self.compress = codecs.check(self.compress, for_="RemoteParameterServer")

    @property
    def address_list(self) -> list[str]:
        """The addresses, validated (a list)."""
        return list(self.addresses)
