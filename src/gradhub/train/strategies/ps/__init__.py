"""``ps-async``, ``ps-sync``, ``ps-ssp``: training against parameter servers.

Each rank is a worker of :class:`~gradhub.ps.client.remote.RemoteParameterServer`
(worker id = rank). The servers hold the parameters and run the optimizer,
built from the script's (:class:`~gradhub.optim.OptimizerSpec`). One step:

1. forward and backward on the worker's part of the global batch, with the
   values it pulled last. Under ``ps-sync`` a synchronising backward ends
   with one all-reduce among the workers, so that ``p.grad`` holds the
   combined gradient, the same bits on every worker, as under DDP;
2. ``optimizer.step()`` pushes each key's gradient (layer ``i`` with
   priority ``-i``: the first layers, needed first by the next forward, go
   first) and pulls every key. In sync mode the pull returns once the round
   is applied; in ssp mode it waits while this worker is more than
   ``max_staleness`` steps ahead of the slowest live one; in async mode at once.

What a DDP line means here (the README's porting table quotes these):

- ``ps-sync``: after a synchronising backward ``p.grad`` is the combined
  gradient (DDP's), so torch's ``clip_grad_norm_`` and
  ``torch.amp.GradScaler`` (``unscale_``, skipped steps) give the
  single-process result; ``step`` sends what ``p.grad`` then holds. Each key
  is pushed whole by one worker (``i % world_size``) and as zeros by the
  others, so the servers' round sum is exactly that gradient.
- ``ps-async``/``ps-ssp``: ``p.grad`` is **this worker's own gradient**
  (no combined gradient exists: the servers apply each push on its own);
  torch's clip and ``GradScaler`` act on it per worker (its own norm, its
  own overflow), and ``step`` pushes it times the worker's share
  (``1 / world_size``, or ``samples / global_samples``).
- Unused parameters: under ``ps-sync`` a parameter no worker used since the
  last synchronising backward keeps ``.grad`` as it was (``None`` after
  ``zero_grad``) on every worker, and a key whose ``.grad`` is None is not
  pushed, so the servers' optimizer does not move it (DDP
  ``find_unused_parameters=True``; the "used" flags ride in the gradients'
  all-reduce); used on some workers only, the others count zeros. Under
  ``ps-async``/``ps-ssp`` a parameter whose ``.grad`` is None on this worker
  is not moved by this worker's update: nothing is pushed (async), or a
  skip push that advances its clock (ssp).
- Set-up: every rank takes rank 0's parameters (frozen ones too) and
  buffers; then the servers' values of the trainable ones (rank 0's unless
  the servers already held the keys). Buffers at each forward: rank 0's,
  broadcast among the workers under every mode, as DDP's
  ``broadcast_buffers=True`` default, so an unchanged DDP script keeps one set
  of batch-norm statistics. Under ``ps-async``/``ps-ssp`` that broadcast makes
  the workers meet at every forward of a model with buffers; pass
  ``broadcast_buffers=False`` to ``prepare`` to keep buffers per worker and
  let them run apart (a model without buffers never meets).
- Checkpoints: ``model.state_dict()`` and ``optimizer.state_dict()`` read
  the servers directly, no collective, so rank 0 alone may call them; the
  files are a plain model's and a plain optimizer's. Optimizer state loaded
  into the plain optimizer before ``prepare`` goes to the servers;
  ``model.load_state_dict`` and ``optimizer.load_state_dict`` after
  ``prepare`` reach them too (see :mod:`.servers` and :mod:`.state`).
- Hyperparameters: every one of the script's groups, of any type (tuples,
  booleans, ``None``), reaches the servers at set-up, and every change
  mid-run (a scheduler, the user) with the next push (see :mod:`.hyper`).
  A custom optimizer class is a ``TypeError`` at set-up; a server fixed to
  another optimizer refuses with
  :class:`~gradhub.errors.OptimizerMismatchError` naming both. With
  ``optimizer=None`` the servers' own optimizer is used.

Other decisions:
- The servers' mode must match the strategy (checked at set-up, from the
  servers' own report). Where the servers come from: :mod:`.discovery`.
- The script's optimizer is never stepped locally, and its local ``state``
  is emptied at set-up: the optimizer state lives on the servers, which
  checkpoint it.
- Loss scaling with :class:`gradhub.GradScaler`: under ``ps-sync`` the
  gradient it unscales is the combined one, identical on every worker, so
  every worker skips the same steps and a skipped step pushes nothing.
  Under ``ps-async``/``ps-ssp`` each worker decides alone; a skipped
  ``ps-ssp`` step sends a *skip push* of every key (the servers count it as
  the worker's step, so the others never wait for a push that does not
  come, and apply nothing); a skipped ``ps-async`` step pushes nothing.
  Both then pull, as a step does. ``torch.amp.GradScaler`` never calls the
  prepared optimizer on a skipped step, so there nothing is pushed and
  nothing pulled, under every mode; under ``ps-ssp`` that worker's clock then
  lags by one step per skip (its skipped steps are not counted), which the
  others wait for only beyond ``max_staleness``.
- :func:`gradhub.check_in_sync` pulls the servers' values first (as
  ``refresh``), so a local change to a replica is replaced, not reported.
  Under ``ps-async``/``ps-ssp`` call it once every worker's last step has
  returned.
- In a surviving job (``gradhub run -n N --survive --servers S``) a worker's
  death leaves the servers and the other workers running: ``ps-sync``
  commits a step on every survivor or on none and ends at the fault-free
  run's parameters; under ``ps-async``/``ps-ssp`` the survivors train the
  dead worker's share again, and each key applies every sample's gradient
  once (no sample lost, none applied twice). See :mod:`.surviving`.
- After torchrun restarted the workers (``gradhub run --max-restarts N``),
  the servers, which kept running, keep their values, and under ``ps-sync``
  and ``ps-ssp`` every worker first catches up with the highest step any
  worker reached on each key, with zero pushes
  (:meth:`~.strategy._PSStrategy._align_steps`).
"""

from __future__ import annotations

from gradhub.ps.client.addresses import ADDRESSES_KEY
from gradhub.train.strategies.ps.discovery import PSConfig, published_addresses
from gradhub.train.strategies.ps.strategy import AsyncPSStrategy, SSPPSStrategy, SyncPSStrategy

__all__ = [
    "ADDRESSES_KEY",
    "AsyncPSStrategy",
    "PSConfig",
    "SSPPSStrategy",
    "SyncPSStrategy",
    "published_addresses",
]
