"""The gradhub exception hierarchy.

Every error the library raises on purpose derives from :class:`GradhubError`.
Errors caused by bad input also derive from the built-in class a Python user
would catch (``ValueError``, ``KeyError``, ``TimeoutError``), so existing
``except`` clauses keep working. Errors from ZeroMQ or c10d are re-raised as
one of these with ``raise ... from exc``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class GradhubError(Exception):
    """Root of every error gradhub raises on purpose."""


class ShapeMismatchError(GradhubError, ValueError):
    """A tree's structure, shape or dtype differs from the stored parameters.

    ``path`` names the place in the tree (``["layer1"]["weight"]``, or ``<root>``),
    ``expected`` and ``received`` describe what differed.
    """

    def __init__(self, path: str, expected: object, received: object, what: str = "shape"):
        self.path = path
        self.expected = expected
        self.received = received
        self.what = what
        super().__init__(f"{what} mismatch at {path}: expected {expected}, received {received}")


class DtypeMismatchError(ShapeMismatchError):
    """A tensor's dtype differs from the stored parameter's (its message says dtype)."""

    def __init__(self, path: str, expected: object, received: object):
        super().__init__(path, expected, received, "dtype")


class NonFiniteError(GradhubError, ValueError):
    """A gradient holds NaN or infinity and the policy is to refuse it."""


class ClosedError(GradhubError, RuntimeError):
    """The object was closed; it refuses any further use."""


class StateError(GradhubError, RuntimeError):
    """A call that is not valid in the object's current state (e.g. ``start()`` twice)."""


class UnknownParameterError(GradhubError, KeyError):
    """A key that was never initialised on the parameter server."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown parameter"


class DuplicateParameterError(GradhubError, ValueError):
    """``init`` of a key that already exists."""


class ProtocolError(GradhubError, ValueError):
    """A malformed, oversized, unauthenticated or unknown wire frame."""


class AuthenticationError(ProtocolError):
    """A frame whose HMAC does not match the shared secret, or a server that
    refused this client's secret (wrong, missing, or given to a server without one)."""


class OversizedError(ProtocolError):
    """A message larger than the endpoint's limit."""


class UnknownOpError(ProtocolError):
    """A well-formed header naming an op, status, codec or dtype this version does not know."""


class OptimizerMismatchError(GradhubError, ValueError):
    """An ``init`` brought an optimizer other than the one the server is fixed to;
    the message names both (class and hyperparameters)."""


class UnsupportedByStrategyError(GradhubError, TypeError):
    """The model or optimizer is one the chosen strategy cannot train as DDP would
    (under ``sharded``: an optimizer whose update is not elementwise per tensor,
    several optimizers, 16-bit parameters); the message names the strategy to
    use instead."""


class BindError(GradhubError, OSError):
    """A server could not bind its address (in use, not an address of this host)."""


class GradhubTimeoutError(GradhubError, TimeoutError):
    """A blocking call ran past its timeout."""


class CollectiveTimeoutError(GradhubTimeoutError):
    """A collective did not complete in time.

    ``missing_ranks`` names the ranks not heard from, ``operation`` the collective.
    """

    def __init__(
        self, operation: str, missing_ranks: Iterable[int], timeout: float, detail: str = ""
    ):
        self.operation = operation
        self.missing_ranks: Sequence[int] = sorted(set(missing_ranks))
        self.timeout = timeout
        ranks = ", ".join(str(r) for r in self.missing_ranks) or "unknown"
        msg = f"{operation} timed out after {timeout:g}s waiting for rank(s) {ranks}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class ServerTimeoutError(GradhubTimeoutError):
    """A parameter server did not answer in time; names the server and the key."""

    def __init__(
        self, server: str, key: str | None, operation: str, timeout: float, detail: str = ""
    ):
        self.server = server
        self.key = key
        self.operation = operation
        self.timeout = timeout
        on_key = f" for key {key!r}" if key is not None else ""
        msg = f"parameter server {server} did not answer {operation}{on_key} within {timeout:g}s"
        super().__init__(msg + (f" ({detail})" if detail else ""))


class ServerUnavailableError(GradhubTimeoutError):
    """Nothing answered at a parameter server's address within the connect timeout."""

    def __init__(self, address: str, timeout: float):
        self.address = address
        self.timeout = timeout
        super().__init__(
            f"no parameter server answered at {address} within {timeout:g}s\n"
            f"- help: is `gradhub serve --bind {address}` running, and is the address right?"
        )


class WorkerFailedError(GradhubError, RuntimeError):
    """Another process of the job died or failed; names which."""


class MisuseError(StateError):
    """A training loop did something that would let the replicas diverge (stepping
    the optimizer handed to ``gradhub.prepare``, stepping with gradients accumulated
    inside ``no_sync()`` and never combined); the message says what to do instead."""


class UnsupportedOptionError(GradhubError, TypeError):
    """A keyword argument (e.g. one of DDP's) that gradhub does not take where it
    was given; the message says why it is not needed and what to write instead."""


class InvalidOptionError(GradhubError, ValueError):
    """An option or argument with a value it cannot take: a strategy option
    (``inner_steps=0``, an ``outer_optimizer`` that is not a callable returning
    a ``torch.optim`` optimizer over the parameters it is given; raised by
    ``gradhub.prepare`` before anything changes), a config field, a
    ``gradhub run`` flag, an argument of a public function (a timeout that is
    not > 0, a rank outside the world); the message says what is allowed."""


class ReplicasDivergedError(GradhubError, RuntimeError):
    """``gradhub.check_in_sync`` found ranks whose parameters differ from rank 0's.

    ``ranks`` lists them."""

    def __init__(self, ranks: Sequence[int], detail: str = ""):
        self.ranks = list(ranks)
        names = ", ".join(str(r) for r in self.ranks)
        super().__init__(
            f"the parameters of rank(s) {names} differ from rank 0's{detail}\n"
            "- help: every rank must step the optimizer gradhub.prepare returned, the "
            "same number of times; check what these ranks did differently"
        )


class RendezvousError(GradhubTimeoutError):
    """This process could not join the job (its store or its peers) within the timeout."""


class LaunchEnvironmentError(GradhubError, ValueError):
    """The launcher's environment (``RANK``, ``WORLD_SIZE``, ...) is incomplete or invalid."""


class UnsupportedTensorError(GradhubError, ValueError):
    """The ``"gradhub"`` torch.distributed backend was given something it does not
    take (a CUDA tensor, a reduction the tensor's dtype has no meaning for); the
    message says what to use instead."""


class NotPreparedError(GradhubError, TypeError):
    """A function that takes the model :func:`gradhub.prepare` returned (or
    ``torch.compile`` of it) was given another object; the message says what
    to pass instead."""


class CollectiveArgumentError(UnsupportedTensorError, RuntimeError):
    """An operation of the ``"gradhub"`` torch.distributed backend refused its
    arguments on the calling rank, from the call itself and before anything was
    sent (a dtype gloo does not take, an op/dtype pair with no meaning, sizes
    or dtypes that do not fit together): the group stays usable. A
    ``RuntimeError``, as gloo's refusal of the same call, and a ``ValueError``
    (:class:`UnsupportedTensorError`)."""


class DevicePlacementError(GradhubError, ValueError):
    """A model on a device the job's process group cannot carry (a CPU model on
    NCCL alone, a CUDA model on a CPU-only backend such as ``"gradhub"``), or on
    another GPU than this rank's; the message says which group or device to use."""


class RunFolderExistsError(GradhubError, FileExistsError):
    """``fit(run_dir=...)`` was given a run folder that already holds the metrics
    of a run (a finished or a killed one), without ``resume=True``; the message
    names the folder. Raised on every rank before training starts, also on
    every attempt of a job that torchrun's agent restarts."""


class SecretFileError(GradhubError, OSError):
    """A shared-secret file (``--secret-file``) that is missing, unreadable or
    empty; the message names the file."""


class TooFewWorkersError(WorkerFailedError):
    """A surviving job (``gradhub run --survive``) lost so many workers that fewer
    than ``--min-workers`` remain; names the members that died. Raised on every
    survivor, which then exits: the job ends as a job without survival would."""

    def __init__(self, dead_now: list[int], dead: list[int], left: int) -> None:
        self.dead = list(dead)
        """Every member (rank of the first generation, or a replacement's id) that died."""
        self.left = left
        super().__init__(
            f"worker(s) {', '.join(map(str, dead_now))} died and {left} worker(s) are left, "
            f"fewer than --min-workers (dead so far: {', '.join(map(str, dead))})\n"
            "- help: check the dead workers' logs; restart the job (it resumes from the "
            "last checkpoint), or lower --min-workers"
        )


class MembershipChangedError(WorkerFailedError):
    """A surviving job's membership changed again (another worker died) while the
    survivors gathered for the group of the previous change: they rebuild over
    the newer membership instead (handled inside gradhub; seen only in logs)."""


class WrongTypeError(GradhubError, TypeError):
    """An argument that is not what the function takes: of another type (a
    model that is not a ``torch.nn.Module``, an optimizer name that is not a
    ``str``, a batch whose size cannot be told), or another object than the one
    it belongs to (a ``GradScaler`` given another optimizer than its own); the
    message names what was given and what is expected."""


class StateLostError(GradhubError, RuntimeError):
    """A surviving job lost state that no survivor holds: under ``sharded`` every
    slice of the optimizer state lives on two ranks, and both holders of a slice
    died in the same change; names the slice and its holders. Raised on every
    survivor, which then exits: the job ends as a job without survival would."""


class BrokenGroupError(WorkerFailedError, StateError):
    """An operation on a group that a peer's death or timeout broke earlier: the
    group is unusable (a :class:`StateError`) because of a peer (a
    :class:`WorkerFailedError`: a surviving job regroups on it). The message
    names the earlier failure."""
