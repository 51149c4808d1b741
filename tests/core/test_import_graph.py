"""The import graph of src/gradhub and src/gradhub_autoload, computed from the source with ast.

Every ``import`` and ``from ... import`` counts, wherever it stands (module
level, inside a function, under ``if TYPE_CHECKING:``): each is an arrow a
reader has to follow. Rules:

- **The runtime is at the bottom.** Its layers, lowest first: the pure
  top-level modules (:data:`BASE`), ``gradhub._shm`` (shared-memory
  primitives), ``gradhub.transports`` (the process-group wrapper and the
  transports), ``gradhub.runtime`` (joining a job). A module of the runtime
  imports only its own layer and those below; nothing in it imports a
  subsystem (``collective``, ``ps``, ``train``, ``backend``, ``cli``, ...).
- **Subsystems do not lean on each other sideways**: ``ps`` never imports
  ``collective`` (both stand on ``_shm``), and neither imports ``train``, the
  CLI or the demo.
- **The parameter server's sides stay apart**: ``ps.client`` and ``ps.server``
  never import each other; what both need is in ``ps.wire`` (which imports
  neither) or at the top of ``ps`` (``base``, ``lanes``, ``secret``).
- **No cycles** between modules.
- **No stubs for another module to fill** anywhere in ``gradhub``
  (:data:`STUB_FREE`): a function whose body is only ``raise
  NotImplementedError`` (a base class whose subclass in another module
  supplies it) is an arrow from the base to the subclass that no import
  shows. A class is given what it needs instead (the client's
  ``ServerRequests`` gets its servers' addresses and the channel's
  ``submit``), or, as a part of a strategy (``train/strategies/part.py``),
  states it as annotations that the strategy fills; an interface says what
  its implementations provide with abstract methods.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

BASE = {
    "gradhub._atomic",
    "gradhub._config",
    "gradhub._version",
    "gradhub.codecs",
    "gradhub.errors",
    "gradhub.optim",
    "gradhub.partition",
    "gradhub.trees",
}
"""Top-level modules with no gradhub dependency beyond one another."""

RUNTIME_LAYERS = [BASE, {"gradhub._shm"}, {"gradhub.transports"}, {"gradhub.runtime"}]
"""The runtime, lowest layer first (a package stands for all its modules)."""

FORBIDDEN = {
    "gradhub.ps": ("gradhub.collective", "gradhub.train", "gradhub.cli", "gradhub.demo"),
    "gradhub.collective": ("gradhub.ps", "gradhub.train", "gradhub.cli", "gradhub.demo"),
    "gradhub.ps.client": ("gradhub.ps.server",),
    "gradhub.ps.server": ("gradhub.ps.client",),
    "gradhub.ps.wire": ("gradhub.ps.client", "gradhub.ps.server"),
    "gradhub.inprocess": (
        "gradhub._shm",
        "gradhub.transports",
        "gradhub.runtime",
        "gradhub.collective",
        "gradhub.ps",
        "gradhub.backend",
        "gradhub.train",
        "gradhub.cli",
        "gradhub.demo",
    ),
}
"""Subsystem (or a side of one) -> packages it must not import."""

STUB_FREE = ("gradhub",)
"""Packages with no ``raise NotImplementedError`` stub (:func:`stubs`): all of gradhub."""

KNOWN_CYCLES: set[frozenset[str]] = set()
"""Cycles that predate this test, being taken apart; remove an entry with its
cycle. Any other cycle fails. (ps.arena.client <-> ps.link and train.fit <->
train.trainer are gone: none is left.)"""


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under ``root``."""
    found = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


PACKAGES = ("gradhub", "gradhub_autoload")
"""The packages under src/ whose arrows count: gradhub and the ``torch.backends``
entry point beside it, which calls into gradhub (so a circle through it counts)."""


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (every import statement)."""
    mods = modules(root)

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for a in node.names:  # `from pkg import module` imports the module
                    full = f"{source}.{a.name}"
                    targets.add(full if full in mods else resolve(source))
        graph[name] = {t for t in targets if t.split(".")[0] in packages and t != name}
    return graph


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(module: str) -> int | None:
    for i, layer in enumerate(RUNTIME_LAYERS):
        if any(within(module, p) for p in layer):
            return i
    return None


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every arrow that breaks the layering rules, as ``a -> b (why)``."""
    found = []
    for source, targets in sorted(graph.items()):
        level = layer_of(source)
        for target in sorted(targets):
            if level is not None:
                below = layer_of(target)
                if below is None:
                    found.append(f"{source} -> {target} (the runtime imports a subsystem)")
                elif below > level:
                    found.append(f"{source} -> {target} (a runtime layer imports one above it)")
            for subsystem, banned in FORBIDDEN.items():
                if within(source, subsystem) and any(within(target, b) for b in banned):
                    found.append(f"{source} -> {target} ({subsystem} must not import it)")
    return found


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def stubs(root: Path, packages: tuple[str, ...] = STUB_FREE) -> list[str]:
    """Every function of ``packages`` whose body (past its docstring) is only
    ``raise NotImplementedError``, as ``module:line name``."""
    found = []
    for name, path in sorted(modules(root).items()):
        if not any(within(name, p) for p in packages):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            body = node.body[1:] if ast.get_docstring(node) is not None else node.body
            raised = body[0].exc if len(body) == 1 and isinstance(body[0], ast.Raise) else None
            if isinstance(raised, ast.Call):
                raised = raised.func
            if isinstance(raised, ast.Name) and raised.id == "NotImplementedError":
                found.append(f"{name}:{node.lineno} {node.name}")
    return found


def test_layers_and_subsystems_hold() -> None:
    graph = import_graph(SRC)
    assert "gradhub.transports.base" in graph and "gradhub.ps.client.arena" in graph
    assert graph["gradhub_autoload"] == {"gradhub.backend.registration"}
    assert violations(graph) == []


def test_no_import_cycles() -> None:
    found = [sorted(c) for c in cycles(import_graph(SRC)) if c not in KNOWN_CYCLES]
    assert found == []


def test_no_stubs_for_another_module_to_fill() -> None:
    assert stubs(SRC) == []


@pytest.mark.parametrize("module", ["gradhub.ps.client.base", "gradhub.train.strategies.scaling"])
def test_the_stub_check_catches_a_planted_stub(tmp_path: Path, module: str) -> None:
    """In the parameter server as in a part of a strategy: a bare and a called
    ``NotImplementedError`` body (after a docstring too) are reported; an
    abstract method's ``...``, a raise among other statements and a stub
    outside :data:`STUB_FREE` (in the autoload entry point) are not."""
    path = Path(*module.split("."))
    files = {f"{package}/__init__.py": "" for package in path.parents[:-1]}
    files |= {
        f"{path}.py": (
            "class Base:\n"
            "    def send(self):\n        raise NotImplementedError\n"
            "    def check(self):\n        '''Doc.'''\n        raise NotImplementedError('x')\n"
            "    @abc.abstractmethod\n    def pull(self):\n        ...\n"
            "    def push(self, n):\n        if n:\n            raise NotImplementedError\n"
        ),
        "gradhub_autoload/__init__.py": "def create():\n    raise NotImplementedError\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert stubs(tmp_path) == [f"{module}:2 send", f"{module}:4 check"]


def test_the_checks_catch_a_bad_arrow(tmp_path: Path) -> None:
    """A small tree with one bad arrow of each kind: each is reported."""
    files = {
        "gradhub/__init__.py": "",
        "gradhub/errors.py": "",
        "gradhub/runtime.py": "from gradhub.train import loop\n",
        "gradhub/_shm/__init__.py": "",
        "gradhub/_shm/memory.py": "from gradhub.transports import group\n",
        "gradhub/transports/__init__.py": "",
        "gradhub/transports/group.py": "from gradhub import errors\n",
        "gradhub/collective/__init__.py": "",
        "gradhub/collective/collectives.py": "from ..transports.group import X\n",
        "gradhub/ps/__init__.py": "",
        "gradhub/ps/arena.py": "def f():\n    from gradhub.collective.collectives import r\n",
        "gradhub/train/__init__.py": "",
        "gradhub/train/loop.py": "import gradhub.train.fit\n",
        "gradhub/train/fit.py": "from gradhub.train import loop\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    # a relative import
    assert graph["gradhub.collective.collectives"] == {"gradhub.transports.group"}
    assert violations(graph) == [
        "gradhub._shm.memory -> gradhub.transports.group (a runtime layer imports one above it)",
        "gradhub.ps.arena -> gradhub.collective.collectives (gradhub.ps must not import it)",
        "gradhub.runtime -> gradhub.train.loop (the runtime imports a subsystem)",
    ]
    assert cycles(graph) == [frozenset({"gradhub.train.loop", "gradhub.train.fit"})]


def test_the_checks_keep_the_ps_client_and_server_apart(tmp_path: Path) -> None:
    """A planted arrow from the client to the server, one back, and one from the
    wire to the client: each is reported; arrows down to the wire and to the
    shared top of ``ps`` are not."""
    files = {
        "gradhub/__init__.py": "",
        "gradhub/ps/__init__.py": "",
        "gradhub/ps/base.py": "",
        "gradhub/ps/client/__init__.py": "",
        "gradhub/ps/client/placement.py": "",
        "gradhub/ps/client/remote.py": (
            "from gradhub.ps.base import ParameterServer\n"
            "from gradhub.ps.wire import protocol\n"
            "from gradhub.ps.server.config import secret_bytes\n"
        ),
        "gradhub/ps/server/__init__.py": "",
        "gradhub/ps/server/config.py": "from gradhub.ps import base\n",
        "gradhub/ps/server/service.py": (
            "from ..wire.protocol import Message\nfrom ..client import placement\n"
        ),
        "gradhub/ps/wire/__init__.py": "",
        "gradhub/ps/wire/protocol.py": "def f():\n    from gradhub.ps.client.remote import R\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["gradhub.ps.server.service"] == {
        "gradhub.ps.wire.protocol",
        "gradhub.ps.client.placement",
    }
    assert violations(graph) == [
        "gradhub.ps.client.remote -> gradhub.ps.server.config"
        " (gradhub.ps.client must not import it)",
        "gradhub.ps.server.service -> gradhub.ps.client.placement"
        " (gradhub.ps.server must not import it)",
        "gradhub.ps.wire.protocol -> gradhub.ps.client.remote (gradhub.ps.wire must not import it)",
    ]


def test_a_circle_through_the_autoload_entry_point_is_caught(tmp_path: Path) -> None:
    """The entry point's late import of gradhub and an import of the entry point
    back from gradhub make a circle like any other."""
    files = {
        "gradhub/__init__.py": "",
        "gradhub/backend/__init__.py": "",
        "gradhub/backend/registration.py": "import gradhub_autoload\n",
        "gradhub_autoload/__init__.py": (
            "def create():\n    from gradhub.backend.registration import create\n"
        ),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cycles(import_graph(tmp_path)) == [
        frozenset({"gradhub_autoload", "gradhub.backend.registration"})
    ]
