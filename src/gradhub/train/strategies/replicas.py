"""Moving whole tensors between replicas: rank 0's values everywhere, unscaling.

Helpers the strategies share (:mod:`.base` calls them):

- :func:`broadcast_tensors` gives every rank one rank's tensors, every dtype
  (integer buffers such as batch norm's ``num_batches_tracked`` included),
  one flat broadcast per dtype; the values arrive bit for bit (a copy, no
  arithmetic), as DDP's ``_sync_module_states``.
- :func:`unscale_tensors` is torch's own unscale kernel.
- :func:`factor` is a gradient's weight as the per-parameter operations take it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

Wait = Callable[[Any, str], None]
"""Bounded wait on a c10d work item (the strategy's ``_wait``)."""


def broadcast_tensors(tensors: Sequence[torch.Tensor], src: int, wait: Wait) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s, in place."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        wait(dist.broadcast(flat, src=src, async_op=True), f"broadcast from rank {src}")
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def unscale_tensors(tensors: list[torch.Tensor], inv_scale: float) -> bool:
    """Multiply ``tensors`` in place by ``inv_scale``; True if any holds inf or NaN.

    torch's own kernel (the one ``torch.amp.GradScaler`` uses), so the bits
    match a single-process run under torch's scaler.
    """
    if not tensors:
        return False
    found = torch.zeros(1, dtype=torch.float32, device=tensors[0].device)
    inv = torch.full((1,), inv_scale, dtype=torch.float32, device=tensors[0].device)
    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, inv)
    return bool(found.item() > 0)


def factor(value: float) -> torch.Tensor:
    """``value`` as a 0-dim fp32 tensor, for the per-parameter ``mul``/``div`` of a
    step: given a Python number, an in-place or ``out=`` operation converts it to a
    tensor on every call (about 2 us, a step's worth per parameter); an fp32
    gradient is multiplied by the number rounded to fp32 either way, the same bits."""
    return torch.tensor(value, dtype=torch.float32)
