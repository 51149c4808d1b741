"""Moving whole tensors between replicas: rank 0's values everywhere, unscaling.

Helpers the strategies share (:mod:`.base` calls them):

- :func:`broadcast_tensors` gives every rank one rank's tensors, every dtype
  (integer buffers such as batch norm's ``num_batches_tracked`` included),
  one flat broadcast per dtype; the values arrive bit for bit (a copy, no
  arithmetic), as DDP's ``_sync_module_states``.
- :func:`unscale_tensors` is torch's own unscale kernel.
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
