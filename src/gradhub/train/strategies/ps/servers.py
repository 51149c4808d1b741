"""The keys of a ``ps-*`` job on its servers: connecting, initialising, reloading.

Decisions:
- One key per trainable parameter, named by the parameter's name in the
  model. Rank 0 ``init``\\ s every key with its values (rank 0's, which every
  rank holds after set-up); a key that already exists (servers restored from
  a checkpoint, or kept from an earlier attempt of the job) keeps the
  servers' value, which every worker then pulls.
- Optimizer state loaded into the plain optimizer before ``prepare``
  (nanoGPT's resume order) goes to the servers with the keys rank 0 creates;
  a key that already existed keeps the servers' state, as it keeps their
  value (the two stay a pair).
- ``model.load_state_dict`` after ``prepare`` (imagenet's resume order) must
  reach the servers, and a server has no "overwrite a value" request: the
  servers apply pushes through the optimizer. So a load makes a new
  *generation* of keys (``name@load1``, ``name@load2``, ...) that rank 0
  initialises with the loaded values, carrying each key's optimizer state
  over from the previous generation (``model.load_state_dict`` leaves the
  optimizer as it was, as under DDP); every worker then uses the new keys.
  The old generation stays on the servers (a load happens a few times per
  job at most). A worker that starts against servers that already hold a
  generation that was trained (pushed to) resumes the latest one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from gradhub.errors import DuplicateParameterError, GradhubError, GradhubTimeoutError
from gradhub.optim import OptimizerSpec
from gradhub.train.strategies.ps.discovery import PSConfig

log = logging.getLogger(__name__)

GENERATION_MARK = "@load"
"""Between a parameter's name and its generation in a key name (``w@load2``)."""

_MAX_GENERATIONS = 10_000


@dataclass
class Key:
    """A trainable parameter and its key on the servers."""

    name: str
    """The parameter's name in the model."""
    param: torch.nn.Parameter
    group: int
    """Index of the script's optimizer group that holds it."""
    wire: str = ""
    """The key on the servers (``name``, or ``name@loadN`` after a load)."""


def wire_name(name: str, generation: int) -> str:
    return name if generation == 0 else f"{name}{GENERATION_MARK}{generation}"


def connect(config: PSConfig, rank: int, addresses: list[str], mode: str, name: str) -> Any:
    """A client of the servers at ``addresses``, checked to run in ``mode``; and their reports."""
    from gradhub.ps.client.remote import RemoteParameterServer

    client = RemoteParameterServer(
        addresses,
        worker_id=rank,
        secret=config.secret,
        timeout=config.timeout,
        # The job's own bound for the first answer too (the client's default is
        # 10 s): a loaded machine can take longer to answer a server's first
        # hello, and a wrong address is still named, within the timeout.
        connect_timeout=config.timeout,
        compress=config.compress,
    )
    try:
        reports = client.stats()
    except GradhubTimeoutError as exc:
        client.close(timeout=0)
        raise GradhubTimeoutError(
            f"parameter server(s) {', '.join(addresses)} unreachable: {exc}\n"
            "- help: check that they run (`gradhub serve --bind ...`) and the addresses"
        ) from exc
    modes = {r.get("mode") for r in reports}
    if modes != {mode}:
        client.close(timeout=0)
        raise GradhubError(
            f"strategy {name!r} needs servers in mode {mode!r}, "
            f"but they run in mode(s) {', '.join(sorted(map(str, modes)))}\n"
            f"- help: start them with --mode {mode} (gradhub run: --ps-mode {mode})"
        )
    return client, reports


def latest_generation(reports: list[dict[str, Any]], keys: list[Key]) -> int:
    """The newest generation of these keys that the servers hold and that was pushed to."""
    names = {k.name for k in keys}
    found = 0
    for report in reports:
        for key in report.get("steps", {}):
            base = key.split("[slice ")[0]
            name, mark, generation = base.rpartition(GENERATION_MARK)
            if mark and name in names and generation.isdigit():
                found = max(found, int(generation))
    return found


def _spec_of(spec: OptimizerSpec | None, key: Key) -> OptimizerSpec | None:
    return None if spec is None else OptimizerSpec(spec.name, (spec.groups[key.group],))


def init_keys(
    client: Any,
    keys: list[Key],
    spec: OptimizerSpec | None,
    local_state: dict[int, dict[str, Any]],
) -> None:
    """Rank 0 at set-up: create the keys the servers lack (``key.wire``), with the
    plain optimizer's state of their parameters (by ``id``)."""
    for key in keys:
        try:
            client.init(key.wire, key.param.detach(), optimizer=_spec_of(spec, key))
        except DuplicateParameterError:
            continue  # kept: the servers' value and state win
        state = local_state.get(id(key.param))
        if state:
            client.set_optimizer_state(key.wire, state, key.param.detach())


def new_generation(
    client: Any, keys: list[Key], generation: int, spec: OptimizerSpec | None
) -> int:
    """Rank 0 after a model load: a fresh generation of every key with the local
    values and the previous generation's optimizer state; returns its number."""
    for candidate in range(generation + 1, generation + _MAX_GENERATIONS):
        try:
            for key in keys:
                client.init(
                    wire_name(key.name, candidate),
                    key.param.detach(),
                    optimizer=_spec_of(spec, key),
                )
        except DuplicateParameterError:  # left by an earlier attempt: take the next one
            continue
        if spec is not None:
            for key in keys:
                old = client.optimizer_state(key.wire, key.param.detach())
                if old:
                    client.set_optimizer_state(
                        wire_name(key.name, candidate), old, key.param.detach()
                    )
        return candidate
    raise GradhubError(
        f"no free generation of the keys after {_MAX_GENERATIONS} tries\n"
        "- help: restart the parameter servers"
    )
