"""The shared secret of a job's servers and clients: as bytes, read from a file.

Both sides turn a secret into bytes the same way (:func:`secret_bytes`), so
a secret read from a file with its trailing newline matches one given on the
command line; HMAC signatures with it: :mod:`gradhub.ps.wire.protocol`.
"""

from __future__ import annotations

from pathlib import Path

from gradhub.errors import SecretFileError, WrongTypeError

__all__ = ["read_secret_file", "secret_bytes"]


def secret_bytes(secret: str | bytes | None) -> bytes | None:
    """A shared secret as bytes (``str`` is UTF-8 encoded), surrounding whitespace
    stripped: the same on servers and clients, so a secret read from a file with
    its trailing newline matches one given on the command line. Empty means none."""
    if secret is None:
        return None
    if isinstance(secret, str):
        secret = secret.encode("utf-8")
    if not isinstance(secret, bytes):
        raise WrongTypeError(f"a secret is str or bytes, got {type(secret).__name__}")
    return secret.strip() or None


def read_secret_file(path: str | Path) -> bytes:
    """The secret in ``path``, through :func:`secret_bytes` (whitespace stripped).

    A missing, unreadable or empty file is a :class:`~gradhub.errors.SecretFileError`."""
    try:
        data = secret_bytes(Path(path).read_bytes())
    except OSError as exc:
        raise SecretFileError(
            f"cannot read the secret file {path}: {exc.strerror or exc}\n"
            "- help: give a file that holds the servers' shared secret (--secret-file)"
        ) from exc
    if data is None:
        raise SecretFileError(f"secret file {path} is empty; put a shared secret in it")
    return data
