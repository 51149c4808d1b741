"""Command-line flags generated from a configuration dataclass.

One source of defaults and help texts: a field ``max_staleness: int = 0`` with
its docstring becomes ``--max-staleness`` (or ``--ps-max-staleness`` with a
prefix), typed from the annotation, defaulting to the field's default, with
the docstring as help. A field's ``metadata`` may refine it:

- ``"flag"``: another flag name (``secret`` is read from ``--secret-file``);
- ``"parse"``: a callable from the command-line string to the field's value;
- ``"choices"``: the accepted values; ``"metavar"``: the placeholder in help.

Fields whose type has no command-line form and no ``"parse"`` are skipped.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import re
import textwrap
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any

_SCALARS: dict[Any, Callable[[str], Any]] = {int: int, float: float, str: str}


def field_docs(cls: type) -> dict[str, str]:
    """The first paragraph of the docstring under each field of ``cls``, as plain text."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                text = after.value.value.split("\n\n")[0]  # the first paragraph
                text = re.sub(r":\w+:`~?([^`]+)`", r"\1", text).replace("``", "")
                docs[node.target.id] = " ".join(text.split())
    return docs


def _parser_for(hint: Any) -> tuple[Callable[[str], Any] | None, bool]:
    """(string -> value, is_bool) for a type hint; ``None`` if it has no command-line form."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _parser_for(rest[0])
        return None, False
    if hint is bool:
        return None, True
    return _SCALARS.get(hint), False


def _fields(cls: type, only: Collection[str] | None, skip: Collection[str]) -> list[Any]:
    return [
        f
        for f in dataclasses.fields(cls)
        if f.init and (only is None or f.name in only) and f.name not in skip
    ]


def _flag(f: Any, prefix: str) -> str:
    return "--" + prefix + str(f.metadata.get("flag", f.name.replace("_", "-")))


def add_config_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    prefix: str = "",
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
    defaults: Mapping[str, Any] | None = None,
    aliases: Mapping[str, str] | None = None,
) -> None:
    """Add one flag per field of the dataclass ``cls`` to ``parser``.

    ``defaults`` overrides a field's default on this command line only;
    ``aliases`` maps a field to one more flag spelling (kept for old scripts).
    """
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in _fields(cls, only, skip):
        parse = f.metadata.get("parse")
        is_bool = False
        if parse is None:
            parse, is_bool = _parser_for(hints[f.name])
            if parse is None and not is_bool:
                continue
        names = [_flag(f, prefix)]
        if aliases and f.name in aliases:
            names.append(aliases[f.name])
        default = (defaults or {}).get(f.name, f.default)
        if default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        help_text = docs.get(f.name, "")
        kw: dict[str, Any] = {"dest": prefix.replace("-", "_") + f.name, "default": default}
        if is_bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = parse
            kw["metavar"] = f.metadata.get("metavar")
            kw["choices"] = f.metadata.get("choices")
        if default not in (None, dataclasses.MISSING, False):
            help_text += f" (default: {default})"
        parser.add_argument(*names, help=help_text.replace("%", "%%"), **kw)


def config_kwargs(
    args: argparse.Namespace,
    cls: type,
    *,
    prefix: str = "",
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
) -> dict[str, Any]:
    """The keyword arguments for ``cls`` that :func:`add_config_flags` parsed into ``args``."""
    out: dict[str, Any] = {}
    for f in _fields(cls, only, skip):
        dest = prefix.replace("-", "_") + f.name
        if hasattr(args, dest):
            out[f.name] = getattr(args, dest)
    return out
