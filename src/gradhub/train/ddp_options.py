"""DDP's keyword arguments, as :func:`gradhub.prepare` takes them under every strategy.

A DDP script's ``DDP(model, **kwargs)`` becomes ``gradhub.prepare(model,
optimizer, **kwargs)``: each of DDP's keywords either keeps DDP's meaning or
is refused with an :class:`~gradhub.errors.UnsupportedOptionError` (a
``TypeError``) that says why it is not needed. They are checked here, in one
place, for every strategy:

- ``find_unused_parameters``: accepted, ``True`` or ``False``. Every strategy
  always finds unused parameters (the "used" flags ride with the gradients),
  so both give DDP's ``find_unused_parameters=True`` result: a parameter no
  rank used keeps ``.grad`` as it was (``None`` after ``zero_grad``) and the
  optimizer does not move it. (DDP with ``False`` raises on such a model.)
- ``broadcast_buffers`` / ``forward_sync_buffers``: DDP's meaning. Buffers are
  broadcast from rank 0 before every forward that follows a forward with
  grad enabled and sync on (DDP's ``require_forward_param_sync``).
  ``broadcast_buffers=False`` also skips the set-up broadcast of buffers;
  ``forward_sync_buffers=False`` keeps it (torch 2.13's split).
- ``gradient_as_bucket_view``: accepted. Under ``allreduce`` ``.grad`` is
  always a view of its bucket (no copy); the flag selects DDP's arithmetic
  for a ``.grad`` that already is one (``True``: divide it in place by the
  world size, as DDP does; ``False``: multiply by ``1 / world_size``; the
  same bits for a power-of-two world size). No effect under the others.
- ``static_graph``, ``check_reduction``: accepted, no effect on results
  (gradhub needs no static-graph knowledge).
- ``bucket_cap_mb``: ``bucket_mb`` of ``allreduce`` and ``sharded``;
  refused under ``ps-*`` (gradients are pushed per parameter, no buckets).
- ``device_ids``, ``output_device``: the model stays on its device (DDP's
  single-device module); ``None`` or that device is accepted, another refused.
  ``dim``: 0 only (no scatter across devices).
- ``process_group``: ``None`` or the default group; gradhub runs on the
  runtime's group (``gradhub.init``), so another one is refused.
- ``init_sync``: ``True`` only (replicas always start from rank 0).
- ``mixed_precision``, ``device_mesh``, ``delay_all_reduce_named_params``,
  ``param_to_hook_all_reduce``, ``skip_all_reduce_unused_params``,
  ``bucket_cap_mb_list``, ``batched_grad_copy``: refused, each with its
  replacement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradhub.errors import UnsupportedOptionError

_BUCKETED = frozenset({"allreduce", "sharded"})
"""Strategies with a ``bucket_mb`` option (DDP's ``bucket_cap_mb``)."""

_REFUSED = {
    "mixed_precision": "use torch.autocast in the loop (with gradhub.GradScaler for fp16)",
    "device_mesh": "gradhub is data-parallel over the runtime's group; drop it",
    "delay_all_reduce_named_params": "gradhub reduces every trainable parameter; drop it",
    "param_to_hook_all_reduce": "gradhub reduces every trainable parameter; drop it",
    "skip_all_reduce_unused_params": "unused parameters are found and skipped always; drop it",
    "bucket_cap_mb_list": "pass one bucket size as bucket_cap_mb=",
    "batched_grad_copy": "gradients are copied into the buckets as they arrive; drop it",
}

KEYWORDS = frozenset(
    {
        "find_unused_parameters",
        "broadcast_buffers",
        "forward_sync_buffers",
        "gradient_as_bucket_view",
        "static_graph",
        "check_reduction",
        "bucket_cap_mb",
        "device_ids",
        "output_device",
        "dim",
        "process_group",
        "init_sync",
        *_REFUSED,
    }
)
"""Every keyword of ``DistributedDataParallel.__init__`` but ``module``."""


@dataclass(kw_only=True)
class DDPOptions:
    """The DDP keywords a strategy acts on (see the module docstring)."""

    broadcast_buffers: bool | None = None
    """DDP's deprecated flag: ``False`` skips buffer broadcasts at set-up and at forward."""
    forward_sync_buffers: bool | None = None
    """Broadcast buffers from rank 0 at forward (DDP default ``True``)."""
    gradient_as_bucket_view: bool = False
    """DDP's arithmetic on a ``.grad`` that is a bucket view (``allreduce``)."""

    @property
    def sync_buffers_at_forward(self) -> bool:
        if self.forward_sync_buffers is not None:
            return self.forward_sync_buffers
        return self.broadcast_buffers is not False

    @property
    def sync_buffers_at_setup(self) -> bool:
        return self.forward_sync_buffers is not None or self.broadcast_buffers is not False


def _refuse(name: str, value: Any, why: str) -> UnsupportedOptionError:
    return UnsupportedOptionError(f"gradhub.prepare does not take {name}={value!r}\n- help: {why}")


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _refuse(name, value, f"{name} is True or False")
    return value


def _check_device(name: str, value: Any, device: torch.device) -> None:
    if value is None:
        return
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise _refuse(name, value, f"one device per process: gradhub uses {device}")
        value = value[0]
    if isinstance(value, int):
        value = torch.device(device.type, value) if device.type != "cpu" else None
    if value is None or torch.device(value) != device:
        raise _refuse(name, value, f"the model is on {device}: drop {name}, or move the model")


def split_ddp_options(
    strategy: str | None, options: dict[str, Any], device: torch.device
) -> tuple[DDPOptions, dict[str, Any]]:
    """Take DDP's keywords out of ``options``; returns them and the strategy's options.

    ``strategy`` is the strategy's name, ``None`` for an instance (whose
    options were given to its constructor). Refused keywords raise here.
    """
    ddp = DDPOptions()
    rest = {k: v for k, v in options.items() if k not in KEYWORDS}
    for name, value in options.items():
        if name not in KEYWORDS:
            continue
        if name in _REFUSED:
            if value in (None, False):
                continue
            raise _refuse(name, value, _REFUSED[name])
        if name in ("find_unused_parameters", "static_graph", "check_reduction"):
            _flag(name, value)
        elif name in ("broadcast_buffers", "forward_sync_buffers", "gradient_as_bucket_view"):
            setattr(ddp, name, _flag(name, value))
        elif name == "init_sync":
            if not _flag(name, value):
                raise _refuse(name, value, "replicas always start from rank 0's values")
        elif name in ("device_ids", "output_device"):
            _check_device(name, value, device)
        elif name == "dim":
            if value != 0:
                raise _refuse(name, value, "each process runs the model on its whole batch")
        elif name == "process_group":
            if value is not None and value is not dist.group.WORLD:
                raise _refuse(name, value, "gradhub runs on the job's default group (gradhub.init)")
        else:
            assert name == "bucket_cap_mb"
            if strategy not in _BUCKETED:
                why = (
                    "pass bucket_mb= to the strategy's constructor"
                    if strategy is None
                    else f"strategy {strategy!r} has no gradient buckets; drop it"
                )
                raise _refuse(name, value, why)
            if "bucket_mb" in options:
                raise _refuse(name, value, "give bucket_mb= or bucket_cap_mb=, not both")
            if value is not None:
                rest["bucket_mb"] = float(value)
    return ddp, rest
