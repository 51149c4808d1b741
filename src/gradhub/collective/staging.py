"""CUDA tensors through a transport that carries host memory: pinned staging buffers.

A group whose process group carries CPU tensors only (gloo; several ranks on
one GPU, say) runs its transports (shared memory, the ring) on host memory.
The collectives of :mod:`.collectives` (and so :class:`~.AllReduceParameter` and
the strategies) hand such a group's CUDA tensors to a :class:`Staging`:

- made on the calling thread when the operation is called: it records an
  event on the stream current there (the stream that produced the tensor,
  and that will consume the result);
- in the operation's body, on the group's worker thread: a side stream waits
  for that event and copies each input to a pinned host buffer
  (``non_blocking``); the worker thread (never the compute stream) waits for
  the copy; the transport runs on the host copies;
- the results are copied back on the side stream (``non_blocking``), and the
  calling thread's stream waits for that copy on the device: nothing the
  caller enqueues after the operation's ``wait()`` returns reads the result
  before it is there, and the compute stream never blocks the host.

Where a group carries CUDA tensors itself (NCCL, alone or in
``"cpu:gloo,cuda:nccl"``), or has one rank (nothing travels), nothing is
staged. A CPU tensor on a group of NCCL alone is moved to the group's GPU
(:func:`placement`), as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradhub.transports.choice import apart
from gradhub.transports.group import CollectiveGroup

_CPU = torch.device("cpu")


def staged(group: CollectiveGroup, device: torch.device) -> bool:
    """Whether an operation of ``group`` on tensors on ``device`` stages them
    through host memory: CUDA tensors on a group of several ranks whose
    transports carry host memory and no backend of which carries them itself."""
    return (
        device.type == "cuda"
        and group.world_size > 1
        and group.device.type == "cpu"
        and not apart(group, device)
    )


def placement(group: CollectiveGroup, device: torch.device) -> torch.device:
    """Where an operation of ``group`` on a tensor from ``device`` runs: on
    ``device`` itself where the group carries it or stages it, else (a CPU
    tensor on NCCL alone) on the group's device."""
    carried = group.backend_of(device) is not None
    return device if carried or device.type == "cuda" else group.device


def begin(group: CollectiveGroup, *tensors: torch.Tensor | None) -> Staging | None:
    """A :class:`Staging` for an operation of ``group`` on ``tensors`` (on the
    calling thread, when the operation is called), or ``None`` where nothing
    is staged."""
    device = next((t.device for t in tensors if t is not None), _CPU)
    return Staging(device) if staged(group, device) else None


def run(
    stage: Staging | None,
    tensor: torch.Tensor,
    out: torch.Tensor,
    body: Callable[[torch.Tensor, torch.Tensor], None],
) -> None:
    """``body(tensor, out)``; with ``stage``, on pinned host copies instead, the
    result copied back into ``out`` (``out`` may be ``tensor``: in place)."""
    if stage is None:
        body(tensor, out)
        return
    host = stage.to_host(tensor)
    host_out = host if out is tensor else stage.empty_host(out)
    body(host, host_out)
    stage.from_host(host_out, out)


class Staging:
    """One operation's CUDA tensors on pinned host buffers (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._consumer = torch.cuda.current_stream(device)
        self._ready = torch.cuda.Event()
        self._ready.record(self._consumer)
        self._side: torch.cuda.Stream | None = None

    def _stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.device)
            self._side.wait_event(self._ready)
        return self._side

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pinned host copy of ``tensor``'s values, there when this returns
        (the calling thread waits for the copy; no stream does)."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        side = self._stream()
        with torch.cuda.device(self.device), torch.cuda.stream(side):
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(side)
            copied = torch.cuda.Event()
            copied.record(side)
        copied.synchronize()
        return host

    def empty_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A pinned host buffer of ``tensor``'s shape and dtype, for a result."""
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)

    def from_host(self, host: torch.Tensor, tensor: torch.Tensor) -> None:
        """Copy ``host`` into ``tensor`` on the side stream; the stream current
        when the operation was called waits for the copy (on the device)."""
        side = self._stream()
        with torch.cuda.device(self.device), torch.cuda.stream(side):
            tensor.copy_(host, non_blocking=True)
            tensor.record_stream(side)
            copied = torch.cuda.Event()
            copied.record(side)
        self._consumer.wait_event(copied)
