"""Tensors as views of one flat fp32 vector: what makes
:class:`~gradhub.collective.AllReduceParameter`'s cycle copy nothing.

As DDP's ``gradient_as_bucket_view`` and FSDP's flat parameters: a model's
parameters become views of the flat weights (``.data`` re-pointed, so
modules and optimizers holding the parameter objects see the views) and
their ``.grad`` views of the flat gradients; backward then accumulates into
the flat gradients in place (autograd adds into an existing ``.grad``).
"""

from __future__ import annotations

import torch

from gradhub.errors import WrongTypeError
from gradhub.trees import Tree, TreeSpec


def occupies(spec: TreeSpec, tree: Tree, flat: torch.Tensor) -> bool:
    """True if ``tree`` is ``flat`` itself (a tensor of as many elements at its
    address), or a tree of ``spec`` whose leaves are the contiguous views of
    ``flat`` at their places (reading or writing them in place moves nothing).
    A tree that does not match ``spec`` raises its ``ShapeMismatchError``."""
    if isinstance(tree, torch.Tensor):
        return (
            tree.numel() == flat.numel()
            and tree.data_ptr() == flat.data_ptr()
            and tree.dtype == flat.dtype
            and tree.is_contiguous()
        )
    address, step = flat.data_ptr(), flat.element_size()
    for t in spec.leaves(tree):
        if t.data_ptr() != address or t.dtype != flat.dtype or not t.is_contiguous():
            return False
        address += step * t.numel()
    return True


def bind_views(
    tensors: list[torch.Tensor],
    flat_weights: torch.Tensor,
    flat_gradients: torch.Tensor,
    where: str,
) -> None:
    """Copy each tensor (the leaves of a tree, in flat order) into its place in
    ``flat_weights`` and re-point it there; its ``.grad`` (copied, or zeros)
    becomes its view of ``flat_gradients``. Tensors that do not require grad
    get no ``.grad``. ``where`` prefixes the error for a tensor that is not fp32
    on the buffers' device (a view cannot change either)."""
    device = flat_weights.device
    for t in tensors:
        if t.dtype != torch.float32 or t.device != device:
            raise WrongTypeError(
                f"{where}: bind takes fp32 tensors on {device}, got {t.dtype} on {t.device}"
                "\n- help: bind a model of fp32 parameters, or pass the tensors to "
                "get_weights/put_gradients (they are copied)"
            )
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            weights = flat_weights[offset : offset + n].view(t.shape)
            weights.copy_(t)
            t.data = weights
            if t.requires_grad:
                grad = flat_gradients[offset : offset + n].view(t.shape)
                if t.grad is None:
                    grad.zero_()
                else:
                    grad.copy_(t.grad)
                t.grad = grad
            offset += n
