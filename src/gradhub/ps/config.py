"""Configuration of a parameter-server process (``gradhub serve``)."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

from gradhub.ps.consistency import MODES
from gradhub.ps.protocol import DEFAULT_MAX_PAYLOAD

OPTIMIZERS = ("sgd", "adam", "descent", "ascent")


def secret_bytes(secret: str | bytes | None) -> bytes | None:
    """A shared secret as bytes (``str`` is UTF-8 encoded); empty means none."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, bytes):
        raise TypeError(f"a secret is str or bytes, got {type(secret).__name__}")
    return secret or None


def read_secret_file(path: str | Path) -> bytes:
    """The secret in ``path`` (surrounding whitespace stripped)."""
    data = Path(path).read_bytes().strip()
    if not data:
        raise ValueError(f"secret file {path} is empty; put a shared secret in it")
    return data


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ endpoint is reachable from this machine only."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    m = re.fullmatch(r"tcp://(.+):([0-9]+|\*)", address)
    if m is None:
        return False
    host = m.group(1).strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # an interface name or host name: assume it is reachable


@dataclass(kw_only=True)
class ServerConfig:
    """What one parameter-server process serves and how."""

    bind: str = "tcp://127.0.0.1:*"
    """ZeroMQ endpoint to bind (``*`` as the port picks a free one). Anything
    but loopback (or ``ipc://``) needs ``secret``."""

    optimizer: str = field(default="sgd", metadata={"choices": OPTIMIZERS})
    """``"sgd"`` or ``"adam"``: a ``torch.optim`` optimizer per key, on the
    server; ``"descent"`` or ``"ascent"``: the ``DistributedGradientsCoordinator``
    engine (value -/+= lr * gradient)."""

    lr: float = 0.01
    """Learning rate of the optimizer."""

    momentum: float = 0.0
    """SGD momentum (ignored by the other optimizers)."""

    mode: str = field(default="async", metadata={"choices": MODES})
    """``"async"``, ``"sync"`` or ``"ssp"`` (see :mod:`gradhub.ps.consistency`)."""

    workers: int = 1
    """Number of workers a sync round (and the ssp bound) waits for before any
    worker has been dropped."""

    max_staleness: int = 0
    """ssp only: how many steps a worker may run ahead of the slowest live one."""

    secret: bytes | None = field(
        default=None, metadata={"flag": "secret-file", "parse": read_secret_file, "metavar": "FILE"}
    )
    """Shared secret for HMAC-SHA256 signatures of every message (str is encoded;
    on the command line: a file holding it, surrounding whitespace stripped)."""

    checkpoint_dir: str | None = None
    """Directory for checkpoints; the server resumes from its file there."""

    checkpoint_every: float = 60.0
    """Seconds between checkpoints (when something changed); one more on shutdown."""

    heartbeat_timeout: float = 10.0
    """A worker silent this long is dropped from sync/ssp accounting."""

    max_payload: int = DEFAULT_MAX_PAYLOAD
    """Largest tensor payload accepted, in bytes; larger messages are dropped."""

    name: str | None = None
    """Name of the checkpoint file (default: derived from ``bind``)."""

    threads: int = 1
    """torch intra-op threads of a server process (``gradhub serve``, or
    ``start_server`` without ``in_thread``; a thread server keeps its caller's
    setting). One by default: an update is a memory-bound pass, and OpenMP
    workers that spin after each parallel update take the cores that the
    ZeroMQ I/O threads and the workers on the same machine need (with torch's
    default, 1 MB pushes in ``benchmarks/parameter_server.py`` on 2 cores had a
    p50 between 0.5 and 8 ms from run to run)."""

    def __post_init__(self) -> None:
        self.secret = secret_bytes(self.secret)
        if not re.fullmatch(r"(tcp|ipc|inproc)://.+", self.bind):
            raise ValueError(
                f"bind address {self.bind!r} is not a ZeroMQ endpoint; use e.g. tcp://127.0.0.1:5555"
            )
        if not is_loopback(self.bind) and self.secret is None:
            raise ValueError(
                f"binding {self.bind} would expose the parameter server beyond this machine "
                "without authentication; give a shared secret (--secret-file) or bind to "
                "tcp://127.0.0.1:PORT"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}"
            )
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_staleness and self.mode != "ssp":
            raise ValueError("max_staleness applies to mode='ssp' only")
        if not self.checkpoint_every > 0:
            raise ValueError(f"checkpoint_every must be positive, got {self.checkpoint_every}")
        if not self.heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout must be positive, got {self.heartbeat_timeout}")
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, got {self.threads}")
        if self.max_payload < 1:
            raise ValueError(f"max_payload must be positive, got {self.max_payload}")

    @property
    def checkpoint_path(self) -> Path | None:
        if self.checkpoint_dir is None:
            return None
        name = self.name or re.sub(r"[^A-Za-z0-9_.-]+", "_", self.bind)
        return Path(self.checkpoint_dir) / f"ps-{name}.pt"
