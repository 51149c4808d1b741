"""Bad input raises an ``errors.py`` class, never a bare ``ValueError`` or ``TypeError``.

The scan reads every module of src/gradhub with ast (the module walk of
``test_import_graph``): a ``raise ValueError``/``raise TypeError`` anywhere, or
one of them built to be handed on (``return ValueError(...)``,
``future.set_exception(TypeError(...))``), fails. The classes of ``errors.py``
also derive from the built-in one, so a caller's ``except ValueError`` keeps
working: the direct tests below check both on public entry points.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from gradhub import LocalParameterServer, RemoteParameterServer, ServerConfig
from gradhub.errors import (
    GradhubError,
    InvalidOptionError,
    UnsupportedOptionError,
    WrongTypeError,
)
from gradhub.ps import ClientConfig
from test_import_graph import SRC, modules, within

BARE = ("ValueError", "TypeError")
"""Built-in classes gradhub raises only through a subclass of its own."""


def bare_errors(root: Path, package: str = "gradhub") -> list[str]:
    """Every place under ``package`` that raises or builds a :data:`BARE` class, as
    ``module:line ValueError``."""
    found: list[tuple[str, int, str]] = []
    for name, path in sorted(modules(root).items()):
        if not within(name, package):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Raise):
                target = node.exc
            elif isinstance(node, ast.Call):
                target = node.func
            else:
                continue
            if isinstance(target, ast.Name) and target.id in BARE:
                found.append((name, node.lineno, target.id))
    return [f"{name}:{line} {cls}" for name, line, cls in sorted(found)]


def test_no_bare_value_or_type_error_in_gradhub() -> None:
    assert "gradhub.ps.server.config" in modules(SRC)  # the walk sees the package
    assert bare_errors(SRC) == []


def test_the_scan_catches_a_planted_bare_error(tmp_path: Path) -> None:
    """A raised class, a raised call (in a nested function too) and a built one
    handed on are reported; a subclass, a re-raise, an ``except`` clause and a
    module outside gradhub are not."""
    files = {
        "gradhub/__init__.py": "",
        "gradhub/ps/__init__.py": "",
        "gradhub/ps/config.py": (
            "from gradhub.errors import InvalidOptionError\n"
            "def check(n):\n"
            "    if n < 0:\n        raise ValueError(f'n is {n}')\n"
            "    if n == 0:\n        raise InvalidOptionError('n is 0')\n"
            "    def inner():\n        raise TypeError\n"
            "    try:\n        inner()\n    except (ValueError, TypeError):\n        raise\n"
            "    return isinstance(n, ValueError)\n"
            "def reply(future):\n    future.set_exception(ValueError('refused'))\n"
        ),
        "gradhub_autoload/__init__.py": "def create():\n    raise ValueError('x')\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert bare_errors(tmp_path) == [
        "gradhub.ps.config:4 ValueError",
        "gradhub.ps.config:8 TypeError",
        "gradhub.ps.config:15 ValueError",
    ]


@pytest.mark.parametrize(
    ("make", "cls", "builtin", "match"),
    [
        (lambda: ServerConfig(workers=0), InvalidOptionError, ValueError, "workers"),
        (lambda: ServerConfig(max_staleness=1), InvalidOptionError, ValueError, "- help:"),
        (lambda: ServerConfig(optimizer=3), WrongTypeError, TypeError, "OptimizerSpec"),  # type: ignore[arg-type]
        (
            lambda: ClientConfig(addresses="tcp://127.0.0.1:1", worker_id="x"),  # type: ignore[arg-type]
            WrongTypeError,
            TypeError,
            "worker_id must be an int",
        ),
        (
            lambda: ClientConfig(addresses="127.0.0.1:5555", worker_id=0),
            InvalidOptionError,
            ValueError,
            "tcp://HOST:PORT",
        ),
        (
            lambda: RemoteParameterServer(
                "tcp://127.0.0.1:1", config=ClientConfig(addresses="tcp://127.0.0.1:1", worker_id=0)
            ),
            UnsupportedOptionError,
            TypeError,
            "not both",
        ),
    ],
)
def test_configs_refuse_bad_values_with_typed_errors(
    make: object, cls: type[GradhubError], builtin: type[Exception], match: str
) -> None:
    with pytest.raises(cls, match=match) as err:
        make()  # type: ignore[operator]
    assert isinstance(err.value, builtin)  # a caller's `except ValueError` still catches it


def test_a_local_server_refuses_bad_arguments_with_typed_errors() -> None:
    with LocalParameterServer() as ps:
        with pytest.raises(TypeError, match="parameter keys are str, got 3") as err:
            ps.init(3, torch.zeros(2))  # type: ignore[arg-type]
        assert isinstance(err.value, WrongTypeError)
        with pytest.raises(WrongTypeError, match="one key per tensor"):
            ps.init("tree", {"a": torch.zeros(2)})  # type: ignore[arg-type]
        with pytest.raises(InvalidOptionError, match="at least one tensor"):
            ps.init("empty", [])
        ps.init("w", torch.zeros(2))
        with pytest.raises(WrongTypeError, match="priority must be an int"):
            ps.push("w", torch.ones(2), priority="high")  # type: ignore[arg-type]
        with pytest.raises(InvalidOptionError, match="no optimizer on this server") as err:
            ps.optimizer_state("w", torch.zeros(2))
        assert isinstance(err.value, ValueError) and "- help:" in str(err.value)
        assert ps.keys() == ["w"]  # nothing refused was stored
