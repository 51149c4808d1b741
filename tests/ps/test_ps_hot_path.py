"""The work of a small push on both sides: no logging call and no elementwise torch
check on the hot path, and the pushes still applied exactly as before."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from gradhub import RemoteParameterServer, ServerConfig, start_server

_LOG_METHODS = ("debug", "info", "warning", "error", "exception", "critical", "log")


def test_small_push_hot_path_logs_nothing_and_skips_torch_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The server in a thread of this process: the patches below see both sides.
    config = ServerConfig(optimizer="sgd", lr=1.0, secret="s")
    with start_server(config, in_thread=True) as server:
        client = RemoteParameterServer(server.address, worker_id=0, secret="s", timeout=30)
        with client:
            client.init("k", torch.zeros(1))
            grad = torch.tensor([0.5])
            for _ in range(5):  # warm-up: hello, first contact, joins are logged
                client.push("k", grad).result()
            calls: Counter[str] = Counter()

            def counting(name: str, original: object) -> object:
                def wrapper(*args: object, **kwargs: object) -> object:
                    calls[name] += 1
                    return original(*args, **kwargs)  # type: ignore[operator]

                return wrapper

            for name in _LOG_METHODS:
                monkeypatch.setattr(
                    logging.Logger, name, counting(name, getattr(logging.Logger, name))
                )
            monkeypatch.setattr(torch, "isfinite", counting("isfinite", torch.isfinite))
            for _ in range(50):
                client.push("k", grad).result()
            monkeypatch.undo()
            out = torch.empty(1)
            client.pull("k", out).result()
    assert not calls, f"calls on the hot path of a 4-byte push: {dict(calls)}"
    assert out.item() == -0.5 * 55  # every push applied once (sgd, lr 1)
