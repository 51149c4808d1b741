"""``diloco``: local steps, then an outer step on the averaged pseudo-gradient.

DiLoCo (Douillard et al. 2023, arXiv 2311.08105): every worker trains on its
own for ``inner_steps`` (H) optimizer steps with the script's optimizer (the
*inner* one, AdamW in the paper), communicating nothing. At every H-th
``optimizer.step()`` the workers meet once:

1. each worker's pseudo-gradient is ``shared - local``: the shared weights
   of the last sync minus its weights now, in fp32;
2. one flat fp32 all-reduce (by default) on the job's group's transport
   (:func:`gradhub.collective.all_reduce`: shared memory on one host, the
   hierarchical path across hosts) sums them, each multiplied by its
   worker's weight, and the sum is divided by the summed weights (host data:
   a 3-float all-reduce behind the flat one, read from host memory, so a
   sync reads nothing back from a device, as ``step_flags`` does);
3. the *outer* optimizer (``outer_optimizer``, by default SGD with lr 0.7 and
   Nesterov momentum 0.9, as the paper) steps the shared fp32 weights with
   that average as their ``.grad``; every worker's model takes the new
   shared weights (rounded to the model's dtype for 16-bit parameters).

Every rank computes the same outer step on the same bits, so after a sync
the replicas are equal, and nothing but the sync travels: about H times
less than ``allreduce`` sends.

Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512), by options
(:class:`DiLoCoConfig`; modules: ``config.py`` the settings, ``fragments.py``
which parameters and which steps, ``exchange.py`` what travels,
``strategy.py`` the loop, ``resync.py`` a surviving job's syncs):

- ``fragments=F``: the parameters are cut into F contiguous fragments of
  about equal size (:mod:`.fragments`); fragment ``f`` syncs once per H
  steps, at the steps ``n`` with ``n % H == f * H // F``, exchanging its own
  pseudo-gradient alone (its own all-reduce or all-gather: 1/F of the bytes
  per sync, F syncs per H steps) and stepping its own weights with the one
  outer optimizer (state per weight). Buffers follow rank 0 at fragment 0's
  syncs.
- ``overlap=tau``: a fragment's exchange starts at its sync step and runs on
  the group's worker thread behind the next tau inner steps; after them it
  is merged: the outer step on the shared weights as above, and the
  fragment's local weights become the new shared weights plus the local
  progress of those tau steps (``local - local at the sync start``, in
  fp32), so no inner step is lost (the paper's alpha-mixing is not offered).
  The progress belongs to the next pseudo-gradient (weights and backward
  counts restart at the sync step). tau = 0 is the blocking sync.
- ``compress=``: the pseudo-gradient travels encoded (``"bf16"``, ``"fp4"``:
  :class:`gradhub.codecs.FP4`), all-gathered, then decoded and summed in fp32
  in rank order on every rank (:mod:`.exchange` gives the bytes); no error
  feedback.

Decisions (DDP's loop, line by line, between syncs):

- ``loss.backward()`` communicates nothing, inside ``no_sync()`` or not:
  ``no_sync()`` and ``model.require_backward_grad_sync`` are accepted and
  change nothing (gradients accumulate locally either way, as on one
  process), and stepping after backward passes that all ran inside
  ``no_sync()`` is allowed (each worker steps on its own gradient anyway).
- ``optimizer.step()`` steps the script's optimizer on this worker's
  ``.grad`` (one *inner step*); every H-th call also runs the sync above.
  ``step`` with no backward since the last one steps on what ``.grad``
  holds, as one process would.
- ``torch.nn.utils.clip_grad_norm_`` and ``gradhub.clip_grad_norm_`` clip
  this worker's gradient by its own norm (no combined gradient exists
  between syncs). LR schedulers and ``param_group["lr"] = ...`` act on the
  inner optimizer, per inner step; the outer optimizer keeps its own
  settings (:attr:`DiLoCoStrategy.outer` takes a scheduler of its own).
- Loss scaling: :class:`gradhub.GradScaler` checks this worker's own
  gradient and skips its own overflowing steps; a skipped step counts as an
  inner step (the sync stays at every H-th ``step`` on every worker).
  ``torch.amp.GradScaler`` does not call ``step`` at all on a skipped step,
  so that worker's syncs would fall behind the others': the sync compares
  the number of backward passes outside ``no_sync()`` each worker made since
  the last one (a difference that is a multiple of 64 goes unseen) and
  raises :class:`~gradhub.errors.MisuseError` on every rank where they
  differ, before anything is changed (use ``gradhub.GradScaler``).
- Weights (``set_samples``): by default every worker counts the same, and
  the average is the plain mean over the workers (as DDP's mean of means).
  After ``model.set_samples(n)`` (or ``set_samples(n, global_n)``) the step
  counts ``n``: a worker's weight is the number of samples behind its
  pseudo-gradient since the last sync, and the average is
  ``sum(N_i d_i) / sum(N_i)``; ``global_n`` is only checked (the sum of the
  weights divides). Give ``set_samples`` on every step or on none: in an
  interval with some, a step without it counts 1. Skipped steps count their
  samples too.
- Buffers: rank 0's at set-up; then each worker's own between syncs (a
  broadcast at every forward would be communication), and rank 0's again at
  every sync (DDP's ``broadcast_buffers=True``; ``False`` keeps each
  worker's own).
- ``join()``, ``register_comm_hook`` and several optimizers are refused at
  their line with a typed error saying what to do.
- Parameters of dtype fp32, bf16 or fp16; the shared weights are fp32 (master
  weights), the pseudo-gradient of a 16-bit parameter is taken against the
  shared weights rounded to its dtype (what the worker started from).
- Checkpoints: ``model.state_dict()`` is this worker's own weights (between
  syncs they differ per worker); ``optimizer.state_dict()`` is the inner
  optimizer's own state dict (a plain optimizer loads it) plus a
  ``"diloco"`` entry: the shared weights, the outer optimizer's state, the
  inner steps since the last sync and the weight and backward count
  gathered since each fragment's last sync, and an exchange in flight (with
  ``overlap``): ``state_dict`` waits for it (every rank started it, so
  waiting starts nothing) and saves its sum, tally and the weights its
  merge keeps the progress from. Neither call communicates (rank 0 alone may
  call them). Loaded after ``prepare`` on every rank (the model first, then the
  optimizer, as ``fit`` does), a worker continues bit for bit as if never
  stopped; for that each rank loads its own file (``fit`` writes one per
  rank), since the inner optimizer's state and the weights between syncs are
  per worker. ``model.load_state_dict`` alone (a pretrained model) makes
  the loaded weights the shared ones. A state loaded into the plain
  optimizer before ``prepare`` keeps only the inner part (torch's
  ``load_state_dict`` drops the ``"diloco"`` entry).
- :func:`gradhub.check_in_sync` between syncs reports the workers as
  diverged: they are, by design. Right after a sync (of every fragment, with
  ``fragments=1``) it passes.

Surviving jobs (``gradhub run --survive``, :mod:`.resync`): a worker's death is
seen at the next sync's exchange; the survivors regroup and redo that sync's
average over themselves (samples-weighted, from what each kept of its own
pseudo-gradient), or, where the exchange had already completed on one of
them, take that one's state; every survivor then continues from the same
shared weights and outer optimizer state. The sync's step stays committed.
``overlap`` and ``servers`` are refused there.

Parameter servers (``servers=``, :mod:`.servers`): the servers hold the
shared weights and the outer optimizer's state and run the outer step; each
worker pushes its pseudo-gradient at its sync and pulls the new shared
weights. ``diloco_mode="sync"`` (servers in mode ``sync``): every worker's
pseudo-gradient in one outer step, as without servers. ``diloco_mode="async"``
(servers in mode ``ssp``): each worker's pseudo-gradient is an outer step of
its own, taken when that worker syncs, and a worker more than the servers'
``max_staleness`` syncs ahead of the slowest waits at its pull. ``fragments``
and ``overlap`` work with servers (a fragment's keys are pushed and pulled at
its syncs; the pull runs behind the overlapped steps); ``compress`` takes
elementwise codecs only there (``fp4`` is an
:class:`~gradhub.errors.UnsupportedOptionError` saying why). Checkpoints
with servers hold no outer state (``"outer"`` is ``None``): a resumed worker
pulls the servers' shared weights at set-up, and its own file brings its
weights, inner state and the shared weights its next pseudo-gradient is
taken against.
"""

from gradhub.train.strategies.diloco.config import (
    DEFAULT_OUTER,
    MODES,
    DiLoCoConfig,
    OuterOptimizer,
)
from gradhub.train.strategies.diloco.strategy import DiLoCoStrategy

__all__ = ["DEFAULT_OUTER", "MODES", "DiLoCoConfig", "DiLoCoStrategy", "OuterOptimizer"]
