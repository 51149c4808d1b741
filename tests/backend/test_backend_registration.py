"""Registering the "gradhub" backend: at `import gradhub`, through torch's entry
point in a process that never imports gradhub, twice, and never breaking `import torch`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch.distributed as dist

import gradhub
import gradhub_autoload


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_registered_by_import_gradhub_and_idempotent() -> None:
    assert "GRADHUB" in dist.Backend._plugins
    assert dist.Backend("gradhub") == "gradhub"
    assert gradhub.backend.register() and gradhub_autoload.register()
    assert gradhub_autoload.NAME == gradhub.backend.NAME
    # gloo stays the default CPU backend: registering takes nothing over
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"


def test_entry_point_registers_at_import_torch() -> None:
    # A process that imports torch only (a Ray Train worker, a subprocess).
    proc = _python(
        "import sys, torch, torch.distributed as dist\n"
        "assert 'GRADHUB' in dist.Backend._plugins\n"
        "assert 'gradhub' not in sys.modules, 'the entry point must not import gradhub'\n"
    )
    assert proc.returncode == 0, proc.stderr


def test_a_failing_registration_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    # What torch's autoloading calls must never raise (torch would turn it into
    # a failed `import torch`): a torch whose register_backend fails.
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no")

    monkeypatch.delitem(dist.Backend._plugins, "GRADHUB")
    monkeypatch.setattr(dist.Backend, "register_backend", broken)
    assert gradhub_autoload.register() is False
    assert gradhub.backend.register() is False
