"""The optimizer state of a ``ps-*`` job, which lives on the servers.

Decisions:
- :func:`fetch` builds the single-process optimizer's ``state_dict`` (per
  parameter state by index, hyperparameters from the script's live groups)
  from the servers directly: one request per key, no collective, so rank 0
  alone may call it while the other ranks train on (nanoGPT and imagenet
  checkpoint on rank 0 only). Under ``ps-async``/``ps-ssp`` the dict is a
  snapshot: what the servers had applied when each key was read.
- :func:`load` takes such a dict (or one a plain optimizer or a job of any
  world size and strategy wrote): hyperparameters into the script's groups
  (they reach the servers with the next push of each key), per-parameter
  state onto the servers, sent by rank 0; every rank calls it, as every
  rank calls ``load_state_dict`` under DDP.
- A frozen parameter has no key on the servers and no state, as in a plain
  optimizer that never stepped it; its index still counts, so the indices
  are the plain optimizer's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from gradhub.errors import InvalidOptionError

WireName = Callable[[torch.Tensor], str | None]
"""The key on the servers of a parameter (``None``: it has none, frozen)."""


def fetch(client: Any, groups: Sequence[Mapping[str, Any]], wire: WireName) -> dict[str, Any]:
    """The servers' optimizer state in the single-process optimizer's format."""
    state: dict[int, dict[str, Any]] = {}
    out_groups: list[dict[str, Any]] = []
    index = 0
    for live in groups:
        ids = []
        for p in live["params"]:
            key = wire(p)
            if key is not None:
                mine = client.optimizer_state(key, p.detach())
                if mine:
                    state[index] = mine
            ids.append(index)
            index += 1
        out_groups.append({**{k: v for k, v in live.items() if k != "params"}, "params": ids})
    return {"state": state, "param_groups": out_groups}


def per_key(
    state: Mapping[str, Any], groups: Sequence[Mapping[str, Any]], wire: WireName
) -> list[tuple[str, torch.Tensor, dict[str, Any]]]:
    """``(key, parameter, its state)`` of every parameter with a key, from a state dict;
    an :class:`~gradhub.errors.InvalidOptionError` (a ``ValueError``) if the dict's
    groups do not match the live ones."""
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, groups, strict=True)
    ):
        raise InvalidOptionError(
            "the optimizer state dict does not match this optimizer's parameter groups "
            f"({[len(s['params']) for s in saved_groups]} parameters per group vs "
            f"{[len(g['params']) for g in groups]})\n- help: load a state dict of an "
            "optimizer built over the same parameters, in the same groups"
        )
    out: list[tuple[str, torch.Tensor, dict[str, Any]]] = []
    for saved, live in zip(saved_groups, groups, strict=True):
        for i, p in zip(saved["params"], live["params"], strict=True):
            key = wire(p)
            if key is not None:
                mine = state["state"].get(i, state["state"].get(str(i), {}))
                out.append((key, p.detach(), dict(mine)))
    return out


def load_hyperparameters(state: Mapping[str, Any], groups: Sequence[dict[str, Any]]) -> None:
    """The saved groups' hyperparameters into the live groups (same dict objects)."""
    for saved, live in zip(state["param_groups"], groups, strict=True):
        live.update({k: v for k, v in saved.items() if k != "params"})


def local_state(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """The per-parameter state a plain optimizer holds (loaded before ``prepare``),
    by ``id`` of the parameter."""
    return {
        id(p): dict(optimizer.state[p])
        for group in optimizer.param_groups
        for p in group["params"]
        if optimizer.state.get(p)
    }
