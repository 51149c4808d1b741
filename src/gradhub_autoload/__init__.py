"""Registers gradhub's ``torch.distributed`` backend ``"gradhub"`` at ``import torch``.

torch loads every ``torch.backends`` entry point while it imports itself
(``torch._import_device_backends``), wrapping any exception in a
``RuntimeError`` that breaks ``import torch``. This package is that entry
point, kept apart from :mod:`gradhub` so that nothing heavy is imported there:
:func:`register` only records a creator that imports
:mod:`gradhub.backend.registration` when a process group is first created
(the one arrow from here into gradhub, taken late), and it swallows every
exception (a torch without the API, a second registration). ``import
gradhub`` registers the same name itself
(:func:`gradhub.backend.registration.register`, which never imports this
package), so the backend is there whichever comes first.
``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns torch's autoloading off.
"""

from __future__ import annotations

from typing import Any

NAME = "gradhub"
"""The backend's name: ``dist.init_process_group("gradhub")`` (the same as
:data:`gradhub.backend.registration.NAME`; a test checks it)."""


def register() -> bool:
    """Register the backend for CPU; ``True`` when it is registered afterwards.

    Idempotent and never raises.
    """
    try:
        import torch.distributed as dist

        if not dist.is_available():
            return False
        backend = dist.Backend
        if NAME.upper() in getattr(backend, "_plugins", {}):
            return True
        backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
        return True
    except Exception:  # never break `import torch` (or `import gradhub`)
        return False


def _create(options: Any, backend_options: Any) -> Any:
    """torch's creator callback: builds the process group (imports gradhub now)."""
    from gradhub.backend.registration import create

    return create(options, backend_options)
