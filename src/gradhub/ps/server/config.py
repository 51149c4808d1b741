"""Configuration of a parameter-server process (``gradhub serve``)."""

from __future__ import annotations

import functools
import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

from gradhub.errors import InvalidOptionError, WrongTypeError
from gradhub.optim import OptimizerSpec
from gradhub.ps.secret import read_secret_file, secret_bytes
from gradhub.ps.server.consistency import MODES
from gradhub.ps.server.store import check_servable
from gradhub.ps.wire.protocol import DEFAULT_MAX_PAYLOAD

NO_OPTIMIZER = "none"


@functools.cache
def default_optimizer() -> OptimizerSpec:
    """The optimizer of a key when neither the server nor the key's ``init`` names one.

    Built on first use, not at import: making any torch optimizer imports
    ``torch._dynamo``, seconds of start-up a process that never steps one
    should not pay.
    """
    return OptimizerSpec.of("sgd", lr=0.01)


def optimizer_spec(name: str, lr: float | None, momentum: float | None) -> OptimizerSpec:
    """The spec of ``--optimizer NAME --lr LR --momentum M``.

    ``NAME`` is a ``torch.optim`` class name (``sgd``, ``adam``, ``adamw``, ...),
    or ``descent``/``ascent``: the coordinator's rules, value -/+= lr * grad,
    which are SGD and SGD with ``maximize=True``. ``lr`` defaults to 0.01.
    """
    hyper: dict[str, float | bool] = {"lr": 0.01 if lr is None else lr}
    if momentum is not None:
        hyper["momentum"] = momentum
    if name in ("descent", "ascent"):
        if momentum:
            raise InvalidOptionError(f"optimizer {name!r} has no momentum; use --optimizer sgd")
        hyper.pop("momentum", None)
        return OptimizerSpec.of("sgd", maximize=name == "ascent", **hyper)
    return OptimizerSpec.of(name, **hyper)


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

    optimizer: OptimizerSpec | str | None = field(
        default=None, metadata={"parse": str, "metavar": "NAME"}
    )
    """The optimizer of every key, fixed: a torch.optim name (sgd, adam, adamw, ...,
    with lr and momentum), descent or ascent (SGD, and SGD maximising), or an
    OptimizerSpec; an init that brings another spec fails with OptimizerMismatchError.
    none: no optimizer, a push replaces the value with the pushed sum. Unset: each
    key takes the spec its init brings, or SGD(lr=0.01) when it brings none.

    ``__post_init__`` turns a name (with ``lr``/``momentum``) into an
    :class:`~gradhub.optim.OptimizerSpec`, so afterwards this is a spec, ``"none"``
    or ``None``, and ``lr``/``momentum`` are ``None``."""

    lr: float | None = None
    """Learning rate of a named optimizer (default 0.01). Alone, without an
    optimizer name, it fixes plain SGD at this rate, momentum 0 unless momentum
    is given too: workers whose optimizer differs (SGD with momentum 0.9, say)
    fail with OptimizerMismatchError."""

    momentum: float | None = None
    """Momentum of a named optimizer (SGD, RMSprop)."""

    mode: str = field(default="async", metadata={"choices": MODES})
    """``"async"``, ``"sync"`` or ``"ssp"`` (see :mod:`gradhub.ps.server.consistency`)."""

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

    durable: bool = False
    """Acknowledge an init or push only once it is on disk: a write-ahead log in the
    checkpoint directory, synced once per batch of requests (group commit) before
    their acknowledgements. Needs checkpoint_dir.

    Without it, an acknowledged push reaches disk with the next checkpoint, and
    the client keeps it until then (``RemoteParameterServer.flush``, called by
    ``close()``, asks for that checkpoint at once)."""

    checkpoint_every: float = 60.0
    """Seconds between checkpoints (when something changed); one more on shutdown."""

    heartbeat_timeout: float = 10.0
    """A worker silent this long is dropped from sync/ssp accounting."""

    max_payload: int = DEFAULT_MAX_PAYLOAD
    """Largest tensor payload accepted, in bytes; larger messages are dropped."""

    name: str | None = None
    """Name of the checkpoint file (default: derived from ``bind``)."""

    arena: bool = True
    """Offer clients on this host a shared-memory arena for tensor payloads
    (:mod:`gradhub.ps.wire.arena`); ``GRADHUB_PS_ARENA=0`` also turns it off."""

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
            raise InvalidOptionError(
                f"bind address {self.bind!r} is not a ZeroMQ endpoint; use e.g. tcp://127.0.0.1:5555"
            )
        if not is_loopback(self.bind) and self.secret is None:
            raise InvalidOptionError(
                f"binding {self.bind} would expose the parameter server beyond this machine "
                "without authentication; give a shared secret (--secret-file) or bind to "
                "tcp://127.0.0.1:PORT"
            )
        self._normalise_optimizer()
        if self.mode not in MODES:
            raise InvalidOptionError(
                f"unknown mode {self.mode!r}; choose one of {', '.join(MODES)}"
            )
        if self.workers < 1:
            raise InvalidOptionError(f"workers must be at least 1, got {self.workers}")
        if self.max_staleness < 0:
            raise InvalidOptionError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.max_staleness and self.mode != "ssp":
            raise InvalidOptionError(
                "max_staleness applies to mode='ssp' only\n- help: give mode='ssp' (--mode ssp) "
                "with it, or leave max_staleness at 0"
            )
        if self.durable and self.checkpoint_dir is None:
            raise InvalidOptionError(
                "durable needs a checkpoint_dir (--checkpoint-dir) for its log"
            )
        if not self.checkpoint_every > 0:
            raise InvalidOptionError(
                f"checkpoint_every must be positive, got {self.checkpoint_every}"
            )
        if not self.heartbeat_timeout > 0:
            raise InvalidOptionError(
                f"heartbeat_timeout must be positive, got {self.heartbeat_timeout}"
            )
        if self.threads < 1:
            raise InvalidOptionError(f"threads must be at least 1, got {self.threads}")
        if self.max_payload < 1:
            raise InvalidOptionError(f"max_payload must be positive, got {self.max_payload}")

    def _normalise_optimizer(self) -> None:
        name, lr, momentum = self.optimizer, self.lr, self.momentum
        if lr is not None and not lr > 0:
            raise InvalidOptionError(f"lr must be positive, got {lr}")
        if isinstance(name, OptimizerSpec) or name == NO_OPTIMIZER:
            if lr is not None or momentum is not None:
                raise InvalidOptionError(
                    f"lr and momentum go with an optimizer name, not with {name!r}"
                )
        elif name is None and lr is None and momentum is None:
            pass  # not fixed: the workers' spec, or default_optimizer()
        elif name is None or isinstance(name, str):
            self.optimizer = optimizer_spec(name or "sgd", lr, momentum)
        else:
            raise WrongTypeError(
                f"optimizer is an OptimizerSpec, a torch.optim name or 'none', got {name!r}"
            )
        if isinstance(self.optimizer, OptimizerSpec):
            check_servable(self.optimizer)
        self.lr = self.momentum = None

    @property
    def checkpoint_path(self) -> Path | None:
        if self.checkpoint_dir is None:
            return None
        name = self.name or re.sub(r"[^A-Za-z0-9_.-]+", "_", self.bind)
        return Path(self.checkpoint_dir) / f"ps-{name}.pt"
