"""The flags of ``gradhub serve`` and the ``--ps-*`` flags of ``gradhub run`` come from
ServerConfig: same defaults, same help texts, every field that has a command-line form."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gradhub.cli._flags import config_kwargs, field_docs
from gradhub.cli.main import build_parser
from gradhub.ps.server.config import ServerConfig


def _serve_config(*argv: str) -> ServerConfig:
    from gradhub.cli import serve

    args = build_parser().parse_args(["serve", *argv])
    return ServerConfig(**config_kwargs(args, ServerConfig, skip=serve._SKIP))


def test_serve_defaults_are_the_config_defaults() -> None:
    parsed = _serve_config()
    expected = ServerConfig(bind="tcp://127.0.0.1:5555")  # the one documented CLI default
    assert dataclasses.asdict(parsed) == dataclasses.asdict(expected)


def test_serve_flags_reach_the_config(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n\n")  # trailing whitespace stripped
    parsed = _serve_config(
        "--mode", "ssp", "--max-staleness", "2", "--workers", "3", "--secret-file", str(secret)
    )
    assert (parsed.mode, parsed.max_staleness, parsed.workers) == ("ssp", 2, 3)
    assert parsed.secret == b"s3cret"


def test_run_ps_flags_and_help_come_from_the_config() -> None:
    from gradhub.cli import run

    parser = build_parser()
    args = parser.parse_args(["run", "-n", "2", "--ps-mode", "ssp", "--max-staleness", "1", "x.py"])
    kwargs = config_kwargs(args, ServerConfig, prefix="ps-", skip=run._PS_SKIP)
    assert kwargs["mode"] == "ssp" and kwargs["max_staleness"] == 1
    defaults = ServerConfig()
    for name, value in kwargs.items():
        if name not in ("mode", "max_staleness"):
            assert value == getattr(defaults, name), name
    sub = next(a for a in parser._subparsers._group_actions)  # type: ignore[union-attr]
    help_text = " ".join(sub.choices["run"].format_help().split())  # type: ignore[attr-defined]
    for name, doc in field_docs(ServerConfig).items():
        if name not in run._PS_SKIP:
            assert "--ps-" + name.replace("_", "-") in help_text or name == "secret", name
            assert doc[:30] in help_text, name


def test_serve_optimizer_flags_build_one_spec(tmp_path: Path) -> None:
    from gradhub.optim import OptimizerSpec

    fixed = _serve_config("--optimizer", "adam", "--lr", "0.001")
    assert fixed.optimizer == OptimizerSpec.of("adam", lr=0.001)
    assert (fixed.lr, fixed.momentum) == (None, None)  # folded into the spec
    assert _serve_config("--lr", "1").optimizer == OptimizerSpec.of("sgd", lr=1.0)
    assert _serve_config().optimizer is None  # takes the workers' spec
    none = _serve_config("--optimizer", "none", "--durable", "--checkpoint-dir", str(tmp_path))
    assert none.optimizer == "none" and none.durable


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--workers", "0"], "workers must be at least 1, got 0"),
        (["--max-staleness", "1"], "max_staleness applies to mode='ssp' only - help: give"),
    ],
)
def test_serve_refuses_a_bad_flag_in_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradhub.cli.main import main

    assert main(["serve", *argv]) == 2  # refused before a server starts
    err = capsys.readouterr().err
    assert err.startswith("gradhub serve: ") and err.count("\n") == 1, err
    assert says in err
