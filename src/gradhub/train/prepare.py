"""``gradhub.prepare``: your own training loop, distributed under every strategy.

.. code-block:: python

    runtime = gradhub.init()
    model, optimizer = gradhub.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-4),
                                       strategy="sharded", compress="bf16")
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        gradhub.clip_grad_norm_(model, 1.0)     # the global norm, under every strategy
        optimizer.step()
        scheduler.step()

What it returns is described in :mod:`gradhub.train.wrapped_model` and
:mod:`gradhub.train.distributed_optimizer`; how each strategy combines the
gradients in :mod:`gradhub.train.strategies`.

Decisions:
- Without ``runtime=``, :func:`gradhub.init` is called (it adopts a process
  group that is already set up). The model stays where the script put it
  (as under DDP): batches go to the model's device. Where the job's group
  cannot carry that device's tensors, a
  :class:`~gradhub.errors.DevicePlacementError` says which group or device
  to use (:mod:`gradhub.train.placement`).
- Every rank must call ``prepare`` with the same model architecture; rank 0's
  initial parameters are used everywhere.
- ``clip_grad_norm_`` clips by the norm of the combined gradient. Under
  ``allreduce``, ``sharded`` and ``ps-sync`` the gradients are combined when
  a synchronising ``backward`` returns (``.grad`` holds the combined gradient,
  the same bits on every rank), so torch's own
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), c)`` and
  ``torch.amp.GradScaler`` work as written too. Under ``ps-async`` and
  ``ps-ssp`` it clips **per worker**: each worker's gradient by its own
  norm, before its push. The servers apply each
  push on its own, against whatever the other workers pushed before, so no
  combined gradient of one step exists to take a norm of, and waiting for
  the others to agree on one would make the updates synchronous. Every
  update is still bounded: a push is at most ``max_norm / world_size`` (its
  share) in norm.
- DDP's keyword arguments (``find_unused_parameters=``, ``broadcast_buffers=``,
  ``bucket_cap_mb=``, ...) are taken here for every strategy and checked in
  one place (:mod:`gradhub.train.ddp_options`): DDP's meaning, or an
  :class:`~gradhub.errors.UnsupportedOptionError` saying why not needed.
- Several optimizers over disjoint parameters (``allreduce`` only): pass a
  list, ``prepare(model, [opt_a, opt_b])``, and get a list of prepared
  optimizers back in the same order; a DDP loop steps each. A list is
  refused by the other strategies (one optimizer with several groups there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch
import torch.distributed as dist

from gradhub.errors import (
    NotPreparedError,
    ReplicasDivergedError,
    UnsupportedOptionError,
    WrongTypeError,
)
from gradhub.runtime import Runtime, init
from gradhub.train.ddp_options import KEYWORDS, split_ddp_options
from gradhub.train.distributed_optimizer import DistributedOptimizer
from gradhub.train.placement import model_device
from gradhub.train.strategies import Strategy, check_name, make_strategy
from gradhub.train.wrapped_model import PreparedModel


@overload
def prepare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    strategy: str | Strategy = ...,
    runtime: Runtime | None = ...,
    **options: Any,
) -> tuple[PreparedModel, DistributedOptimizer]: ...


@overload
def prepare(
    model: torch.nn.Module,
    optimizer: Sequence[torch.optim.Optimizer],
    *,
    strategy: str | Strategy = ...,
    runtime: Runtime | None = ...,
    **options: Any,
) -> tuple[PreparedModel, list[DistributedOptimizer]]: ...


def prepare(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
    *,
    strategy: str | Strategy = "allreduce",
    runtime: Runtime | None = None,
    **options: Any,
) -> tuple[PreparedModel, DistributedOptimizer | list[DistributedOptimizer]]:
    """Make ``model`` and ``optimizer`` distributed with ``strategy``; see the module doc.

    ``options`` go to the strategy (``bucket_mb=``, ``compress=``,
    ``servers=``, ...). Returns ``(model, optimizer)`` to use in their place.
    ``optimizer=None`` is accepted by the ``ps-*`` strategies only: the
    servers then use the optimizer they were started with. A list of
    optimizers gives a list of prepared ones (``allreduce``). DDP's keywords
    are accepted as :mod:`gradhub.train.ddp_options` says.
    """
    if isinstance(model, PreparedModel):
        raise WrongTypeError("this model was already prepared; pass the original module")
    if not isinstance(model, torch.nn.Module):
        raise WrongTypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    several = isinstance(optimizer, (list, tuple))
    given: list[Any] = list(optimizer) if several else [optimizer]  # type: ignore[arg-type]
    if not given or any(
        isinstance(o, DistributedOptimizer)
        or not (o is None or isinstance(o, torch.optim.Optimizer))
        or (o is None and several)
        for o in given
    ):
        raise WrongTypeError(
            "optimizer must be the script's torch.optim.Optimizer (or a list of them), "
            "built over model.parameters()"
        )
    if isinstance(strategy, str):
        check_name(strategy)
    if not isinstance(strategy, str) and set(options) - KEYWORDS:
        raise UnsupportedOptionError(
            "options go to the strategy's constructor, not with an instance"
        )
    runtime = runtime if runtime is not None else init()
    name = strategy if isinstance(strategy, str) else None
    ddp, options = split_ddp_options(name, options, model_device(model, runtime))
    impl = make_strategy(strategy, **options) if isinstance(strategy, str) else strategy
    impl.ddp = ddp
    impl.setup(model, given if several else given[0], runtime)  # None: only ps-*
    # Under ps-* without an optimizer, a stand-in that is never stepped keeps the API whole.
    if given[0] is None:
        given = [torch.optim.SGD(model.parameters(), lr=0.0)]
    prepared = [DistributedOptimizer(o, impl, i) for i, o in enumerate(given)]
    return PreparedModel(model, impl), prepared if several else prepared[0]


def _strategy_of(model: Any, caller: str) -> Strategy:
    """The strategy of a prepared model, also seen through ``torch.compile``'s
    wrapper (an ``OptimizedModule``, whose ``_orig_mod`` is the prepared model)."""
    inner = model
    while not isinstance(inner, PreparedModel) and isinstance(inner, torch.nn.Module):
        inner = getattr(inner, "_orig_mod", None)
    if not isinstance(inner, PreparedModel):
        raise NotPreparedError(
            f"{caller} takes the model gradhub.prepare returned (or torch.compile of it), "
            f"got {type(model).__name__}\n"
            "- help: pass the model gradhub.prepare returned; or clip with torch's "
            "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), which works on "
            "it too under allreduce, sharded and ps-sync"
        )
    return inner.strategy


def clip_grad_norm_(
    model: PreparedModel | torch.nn.Module, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip the gradients of a prepared model by their global norm; returns the norm.

    ``model``: what :func:`prepare` returned, or ``torch.compile`` of it. Call
    it between ``backward`` and ``optimizer.step()``, as
    ``torch.nn.utils.clip_grad_norm_``. Under ``ps-async``/``ps-ssp`` the norm
    is this worker's own gradient's and each worker clips its own (no global
    gradient exists there; see the module docstring).
    """
    strategy = _strategy_of(model, "gradhub.clip_grad_norm_")
    return strategy.clip_grad_norm_(float(max_norm), float(norm_type))


def check_in_sync(model: PreparedModel | torch.nn.Module, runtime: Runtime | None = None) -> None:
    """Raise :class:`~gradhub.errors.ReplicasDivergedError` naming the ranks whose
    parameters differ from rank 0's; return quietly when all are equal.

    A collective: every rank calls it. The checksum is exact (the parameters'
    bits summed as integers, plain and position-weighted), so any difference
    in any bit shows. Under ``ps-async``/``ps-ssp`` replicas legitimately
    differ between pulls; call it after ``refresh`` at a point where no push
    is in flight.
    """
    if isinstance(model, PreparedModel):
        rt = model.strategy.runtime
        model.strategy.refresh()
        params = list(model.module.parameters())
    else:
        rt = runtime if runtime is not None else init()
        params = list(model.parameters())
    bits = torch.cat([p.detach().reshape(-1).float().cpu() for p in params]).view(torch.int32)
    wide = bits.to(torch.int64)
    plain = int(wide.sum())
    weighted = int((wide * torch.arange(1, wide.numel() + 1, dtype=torch.int64)).sum())
    mine = torch.tensor([plain, weighted], dtype=torch.int64)
    everyone = [torch.zeros(2, dtype=torch.int64) for _ in range(rt.world_size)]
    if rt.world_size > 1:
        gather = rt.collective(
            "all_gather",
            lambda: dist.all_gather(everyone, mine, async_op=True),
            where="check_in_sync",
        )
        rt.wait(gather)
    else:
        everyone = [mine]
    differ = [r for r, t in enumerate(everyone) if not torch.equal(t, everyone[0])]
    if differ:
        raise ReplicasDivergedError(differ)
