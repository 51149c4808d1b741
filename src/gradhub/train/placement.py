"""Where a prepared model lives: where the script put it, checked against the job's group.

:func:`gradhub.prepare` moves nothing, as DDP moves nothing:
:attr:`Runtime.device <gradhub.runtime.Runtime.device>` is where batches go by
default, and the model is trained on the device its parameters are on.
:func:`model_device` checks that the job's process group can carry that
device's tensors, before any collective runs, and raises
:class:`~gradhub.errors.DevicePlacementError` saying what to do where it cannot
(decisions, DDP's behaviour where it has one):

- One device per model (parameters and buffers), not the meta device: the
  strategies keep one flat vector or one set of buckets on it. (DDP takes
  multi-device modules; gradhub's strategies do not.)
- A CPU model needs a group that carries CPU tensors: gloo,
  ``"cpu:gloo,cuda:nccl"`` (the default on a CUDA machine) or ``"gradhub"``.
  On NCCL alone DDP fails at its first broadcast ("No backend type
  associated with device type cpu"); here the error names the group to use.
- A CUDA model where the group carries CUDA tensors on NCCL must be on this
  rank's GPU (``runtime.device``, picked by ``LOCAL_RANK``): NCCL serves one
  GPU per rank, and DDP on another GPU than the rank's ends in NCCL's
  "Duplicate GPU detected" as soon as two ranks share one.
- A CUDA model on gloo (say, several ranks on one GPU): gloo's own
  collectives take CUDA tensors, and gradhub's collectives stage them through
  pinned host memory (:mod:`gradhub.collective.staging`). Any other backend
  that carries CPU tensors only (``"gradhub"``: it refuses CUDA tensors) is
  refused here.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from gradhub.errors import DevicePlacementError

if TYPE_CHECKING:
    from gradhub.runtime import Runtime

_BOTH = (
    'gradhub.init() without backend= ("cpu:gloo,cuda:nccl" on a CUDA machine) '
    "carries both CPU and CUDA tensors"
)


def model_device(model: torch.nn.Module, runtime: Runtime) -> torch.device:
    """The one device of ``model``'s parameters and buffers (``runtime.device``
    for a model without any), checked against ``runtime``'s group (see the
    module docstring)."""
    devices = {t.device for t in itertools.chain(model.parameters(), model.buffers())}
    if not devices:
        return runtime.device
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise DevicePlacementError(
            f"the model's parameters and buffers are on several devices ({names}); "
            "gradhub.prepare trains a model on one device\n"
            "- help: move it to one device first: model.to(runtime.device)"
        )
    device = devices.pop()
    check_device(device, runtime.device, runtime.group.backends, runtime.backend)
    return device


def check_device(
    device: torch.device, rank_device: torch.device, backends: dict[str, str], backend: str
) -> None:
    """Raise :class:`~gradhub.errors.DevicePlacementError` where a group whose
    ``backends`` (device type -> backend; torch's name ``backend``) cannot train
    a model on ``device``; ``rank_device``: this rank's default device."""
    if device.type == "meta":
        raise DevicePlacementError(
            "the model is on the meta device: its parameters hold no values\n"
            "- help: materialize it first (model.to_empty(device=...) and initialise it)"
        )
    if device.type == "cpu":
        if "cpu" not in backends:
            raise DevicePlacementError(
                f"the model is on the CPU, but the job's process group ({backend!r}) carries "
                f"CUDA tensors only\n- help: move the model to this rank's GPU before "
                f"prepare: model.to(runtime.device) ({rank_device}); or {_BOTH}"
            )
        return
    carrier = backends.get(device.type)
    if carrier == "nccl":
        if device != rank_device:
            raise DevicePlacementError(
                f"the model is on {device}, but this rank's GPU is {rank_device} "
                "(LOCAL_RANK modulo the GPUs): NCCL serves one GPU per rank\n"
                "- help: model.to(runtime.device) before gradhub.prepare; or choose the "
                "GPU with CUDA_VISIBLE_DEVICES"
            )
        return
    if carrier is None and backends.get("cpu") != "gloo":
        raise DevicePlacementError(
            f"the model is on {device}, but the job's process group ({backend!r}) carries "
            f"CPU tensors only\n- help: {_BOTH}; backend='gloo' carries CUDA tensors "
            "through host memory"
        )
