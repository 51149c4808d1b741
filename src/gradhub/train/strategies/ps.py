"""``ps-async``, ``ps-sync``, ``ps-ssp``: training against parameter servers.

Each rank is a worker of :class:`~gradhub.ps.remote.RemoteParameterServer`
(worker id = rank). The servers hold the parameters and run the optimizer;
one step on a worker is:

1. forward and backward on its part of the global batch, with the values it
   pulled last;
2. push every parameter's gradient scaled by ``samples / global_samples``
   (layer ``i`` with priority ``-i``, so the first layers, needed first by the
   next forward pass, go first): a sync round's sum is then exactly the
   gradient of the mean loss over the global batch, and an asynchronous push
   is that worker's share of it;
3. pull every parameter. In sync mode the pull returns once the round is
   applied; in ssp mode it waits while this worker is more than
   ``max_staleness`` steps ahead of the slowest live one; in async mode at once.

The servers' mode must match the strategy (checked at set-up, from the
servers' own report). Where the servers come from:

- ``servers=[...]`` (addresses, e.g. ``"tcp://10.0.0.5:5555"``), started by the
  user with ``gradhub serve``; or
- ``gradhub run --servers S`` starts S servers before the workers and
  publishes their addresses in the launcher's c10d store (key
  :data:`ADDRESSES_KEY`, a JSON list), where this strategy reads them.

Decisions:
- Rank 0 ``init``\\ s every key with its initial values; a key that already
  exists (servers restored from a checkpoint, or kept from an earlier job)
  keeps the server's value, which every worker then pulls.
- The servers' optimizer is built from the script's: its ``torch.optim`` class
  and every hyperparameter of the parameter's group (an
  :class:`~gradhub.optim.OptimizerSpec` sent with each key's ``init``), never
  silently replaced. A custom optimizer class is a ``TypeError`` at set-up; a
  server fixed to another optimizer refuses with
  :class:`~gradhub.errors.OptimizerMismatchError` naming both. With
  ``optimizer=None`` the servers' own optimizer is used.
- Hyperparameters are live: a numeric hyperparameter of a group that changed
  since the last step (an LR scheduler's ``lr``) travels with that step's
  pushes of the group's keys and is set on the servers before they apply them.
- The script's optimizer is never stepped locally: the optimizer state lives
  on the servers, which checkpoint it. The prepared optimizer's
  ``state_dict()`` fetches it from them (every parameter's state, in the
  single-process optimizer's format: a plain optimizer or a job of any world
  size and strategy loads it), and ``load_state_dict()`` sends a state dict's
  per-parameter state to them (rank 0) and its hyperparameters into the
  script's groups. Under ``ps-async``/``ps-ssp`` the dict is a snapshot: the
  pushes the servers applied when each key was read.
- ``clip_grad_norm_`` under ``ps-sync`` sums the weighted gradients over the
  workers (one all-reduce), clips the sum by its norm and has every worker
  push ``1 / world_size`` of it, so the servers apply the clipped global
  gradient; under ``ps-async``/``ps-ssp`` no global gradient exists and each
  worker's weighted gradient is clipped by its own norm before the push.
- Misuse: the three errors of :mod:`.base` hold here too. Stepping the
  script's optimizer would update this worker's replica alone (the next pull
  overwrites it, the step is lost). A second backward outside ``no_sync()``
  before ``step``, and a ``step`` after backward passes inside ``no_sync()``
  only, would be harmless here (a backward communicates nothing; the push
  happens at ``step``), but they are refused all the same: the same loop must
  run under every strategy, and under ``allreduce``/``sharded`` the first
  pairs mismatched collectives and the second steps on uncombined gradients.
  Refusing them here means a loop does not start failing when its strategy
  changes.
- :func:`gradhub.check_in_sync` pulls the servers' values first (as
  ``refresh``), so a local change to a replica is replaced, not reported: the
  replicas cannot drift apart from the servers for longer than until the
  next pull. Under ``ps-async``/``ps-ssp`` call it once every worker's last
  step has returned (a push is applied before its worker's step returns).
- Model buffers (e.g. batch-norm statistics) stay local to each worker.
- Loss scaling (:class:`gradhub.GradScaler`): ``unscale_`` unscales the
  worker's gradient before it is pushed, so only unscaled values travel (the
  ``"fp16"`` wire never carries a scaled gradient). Under ``ps-sync`` the
  found-inf flag is all-reduced over the runtime's group: every worker skips
  the same step and pushes nothing, so no round waits for a missing push.
  Under ``ps-async``/``ps-ssp`` each worker decides alone (its push is
  applied on its own; nobody waits for it) and its scale follows its own
  gradients. A skipped ``ps-ssp`` step sends a *skip push* of every key:
  the servers count it as the worker's step (the staleness clock moves on,
  so the others never wait for a push that does not come) and apply
  nothing. A skipped ``ps-async`` step pushes nothing. Both then pull, as a
  step does.
- After torchrun restarted the workers (``gradhub run --max-restarts N``),
  the servers, which kept running, keep their values, and under ``ps-sync``
  and ``ps-ssp`` every worker first catches up with the highest step any
  worker reached on each key, with zero pushes (see :meth:`_PSStrategy._align_steps`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from gradhub import codecs
from gradhub._config import config_or_options
from gradhub.errors import DuplicateParameterError, GradhubError, GradhubTimeoutError
from gradhub.optim import OptimizerSpec
from gradhub.train.strategies.base import Strategy, unscale_tensors

log = logging.getLogger(__name__)

ADDRESSES_KEY = "gradhub/ps/addresses"
"""Key in the launcher's c10d store under which ``gradhub run --servers`` puts
the parameter-server addresses (a JSON list of ZeroMQ endpoints)."""


@dataclass(kw_only=True)
class PSConfig:
    """Settings of the parameter-server strategies."""

    servers: list[str] | None = None
    """Server addresses; ``None`` reads those ``gradhub run --servers`` published."""
    secret: str | bytes | None = None
    """Shared secret when the servers require one."""
    timeout: float = 60.0
    """Seconds a push or pull may take (ssp/sync waits included) before an error."""
    compress: str = "none"
    """Wire codec for gradients (``"none"``, ``"fp16"``, ``"bf16"``, ...)."""

    def __post_init__(self) -> None:
        if isinstance(self.servers, str):
            self.servers = [self.servers]
        if self.servers is not None and not self.servers:
            raise ValueError("servers is an empty list; give at least one address or None")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        codecs.check(self.compress, for_="ps-async/ps-sync/ps-ssp")


def published_addresses(timeout: float = 10.0) -> list[str] | None:
    """The addresses ``gradhub run --servers`` published, or ``None`` if there are none.

    Reads the launcher's store at ``MASTER_ADDR:MASTER_PORT`` (torchrun's
    standard environment).
    """
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout),
    )
    try:
        store.wait([ADDRESSES_KEY], timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError):
        return None
    addresses: list[str] = json.loads(store.get(ADDRESSES_KEY))
    return addresses


class _PSStrategy(Strategy):
    mode: ClassVar[str]
    needs_optimizer = False
    state_outlives_workers = True

    def __init__(self, config: PSConfig | None = None, **options: Any) -> None:
        super().__init__()
        self.config = config_or_options(PSConfig, config, options)
        self._client: Any = None
        self._keys: list[tuple[str, torch.nn.Parameter, int]] = []  # name, parameter, group
        self._sent: list[dict[str, Any]] = []  # per group: hyperparameters the servers have
        self._combined: torch.Tensor | None = None  # ps-sync after clipping: what to push

    def _setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        from gradhub.ps.remote import RemoteParameterServer

        rt = self.runtime
        spec = OptimizerSpec.of(optimizer) if optimizer is not None else None
        addresses = self.config.servers or published_addresses(min(10.0, rt.timeout))
        if not addresses:
            raise GradhubError(
                f"strategy {self.name!r} needs parameter servers and none were given\n"
                "- help: launch with `gradhub run -n N --servers S script.py`, or pass "
                "servers=['tcp://HOST:PORT', ...] (started with `gradhub serve`)"
            )
        group_of = {}
        if optimizer is not None:
            group_of = {
                id(p): g for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]
            }
            self._sent = [self._numeric(g) for g in optimizer.param_groups]
        trainable = {id(p) for p in self.params}
        self._keys = [
            (n, p, group_of.get(id(p), 0))
            for n, p in model.named_parameters()
            if id(p) in trainable
        ]
        self._client = RemoteParameterServer(
            addresses,
            worker_id=rt.rank,
            secret=self.config.secret,
            timeout=self.config.timeout,
            compress=self.config.compress,
        )
        try:
            reports = self._client.stats()
        except GradhubTimeoutError as exc:
            self._client.close(timeout=0)
            raise GradhubTimeoutError(
                f"parameter server(s) {', '.join(addresses)} unreachable: {exc}\n"
                "- help: check that they run (`gradhub serve --bind ...`) and the addresses"
            ) from exc
        modes = {r.get("mode") for r in reports}
        if modes != {self.mode}:
            self._client.close(timeout=0)
            raise GradhubError(
                f"strategy {self.name!r} needs servers in mode {self.mode!r}, "
                f"but they run in mode(s) {', '.join(sorted(map(str, modes)))}\n"
                f"- help: start them with --mode {self.mode} (gradhub run: --ps-mode {self.mode})"
            )

        def init_keys() -> None:
            for name, p, g in self._keys:
                one = None if spec is None else OptimizerSpec(spec.name, (spec.groups[g],))
                # A key restored or kept by the servers keeps their value.
                with contextlib.suppress(DuplicateParameterError):
                    self._client.init(name, p.detach(), optimizer=one)

        try:
            self._on_rank0(init_keys, "initialise the parameters on the servers")
            if rt.restart and self.mode != "async":
                self._align_steps()
        except Exception:
            self._client.close(timeout=0)
            raise
        self.refresh()

    def _align_steps(self) -> None:
        """After torchrun restarted the workers (sync, ssp): bring every worker's
        step on every key up to the highest, with zero pushes.

        The workers of the failed attempt stopped at different points, one step
        apart (sync) or up to ``max_staleness + 1`` (ssp), and the servers count
        steps per worker: near the end of the job a sync round or an ssp wait
        would wait for pushes that never come. A zero push joins its sync round
        without changing its sum; under ssp it is applied on its own (an
        optimizer step with a zero gradient, which momentum still moves).
        Rank 0 reads the steps once every worker of this attempt has joined and
        none has pushed; every rank pads its own.
        """
        rt = self.runtime
        plan: list[dict[int, dict[str, int]] | None] = [None]
        if rt.is_main:
            steps: dict[str, dict[int, int]] = {}
            for report in self._client.stats():
                for key, per_worker in report.get("steps", {}).items():
                    name = key.split("[slice ")[0]  # a sliced key counts as its largest slice
                    known = steps.setdefault(name, {})
                    for w, n in per_worker.items():
                        known[int(w)] = max(known.get(int(w), 0), int(n))
            plan[0] = {
                rank: {
                    name: max(by.values()) - by.get(rank, 0)
                    for name, by in steps.items()
                    if max(by.values()) > by.get(rank, 0)
                }
                for rank in range(rt.world_size)
            }
        if rt.world_size > 1:
            dist.broadcast_object_list(plan, src=0)
        mine = (plan[0] or {}).get(rt.rank, {})
        pushes = [
            self._client.push(name, torch.zeros_like(p), priority=-i)
            for i, (name, p, _) in enumerate(self._keys)
            for _ in range(mine.get(name, 0))
        ]
        self._settle(pushes)
        if mine:
            log.info(
                "[rank %d] restart: %d zero push(es) to catch up with the other workers' steps",
                rt.rank,
                len(pushes),
            )

    def _on_rank0(self, work: Callable[[], None], what: str) -> None:
        """Run ``work`` on rank 0; every rank returns once it is done, or raises if it failed."""
        rt = self.runtime
        failed: Exception | None = None
        if rt.is_main:
            try:
                work()
            except Exception as exc:
                failed = exc
        flag = torch.tensor([1.0 if failed is not None else 0.0])
        rt.all_reduce_sum(flag, where=f"parameter servers: {what}")
        if failed is not None:
            raise failed
        if flag.item() > 0:
            raise GradhubError(f"rank 0 could not {what} ({self.name}); its error says why")

    @staticmethod
    def _numeric(group: dict[str, Any]) -> dict[str, Any]:
        return {
            k: v
            for k, v in group.items()
            if k != "params" and isinstance(v, int | float) and not isinstance(v, bool)
        }

    def _changes(self) -> list[dict[str, Any] | None]:
        """Per group: the numeric hyperparameters changed since the servers last got them."""
        if self.optimizer is None:
            return []
        out: list[dict[str, Any] | None] = []
        for g, group in enumerate(self.optimizer.param_groups):
            sent = self._sent[g]  # keys the servers' groups have (a scheduler's
            # bookkeeping such as initial_lr, added later, stays local)
            changed = {k: group[k] for k in sent if group.get(k) != sent[k]}
            sent.update(changed)
            out.append(changed or None)
        return out

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if self.mode != "sync":  # no global gradient exists: clip this worker's share
            return torch.nn.utils.clip_grad_norm_(self.params, max_norm, norm_type=norm_type)
        # ps-sync: the servers apply the sum of the pushes. Sum the weighted
        # gradients here (one all-reduce), clip that by its norm, and let every
        # worker push 1/world of it: the servers' sum is the clipped gradient.
        scale = self._scale()
        flat = torch.cat(
            [
                (p.grad.detach() * scale if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for _, p, _ in self._keys
            ]
        )
        self.runtime.all_reduce_sum(flat, where="gradient norm")
        norm: torch.Tensor = torch.linalg.vector_norm(flat, norm_type)
        flat.mul_(torch.clamp(max_norm / (norm + 1e-6), max=1.0) / self.world_size)
        self._combined = flat
        return norm

    def _scale(self) -> float:
        scale, by_count = self._weights()
        if by_count:
            total = self.runtime.all_reduce_sum(torch.tensor([scale]), where="sample count")
            scale = scale / float(total[0])
        return scale

    def _apply(self) -> None:
        combined, self._combined = self._combined, None
        scale = self._scale() if combined is None else 1.0
        changes = self._changes()
        pushes: list[Future[None]] = []
        offset = 0
        for i, (name, p, g) in enumerate(self._keys):
            if combined is not None:
                grad = combined[offset : offset + p.numel()].view_as(p)
            else:
                grad = torch.zeros_like(p) if p.grad is None else p.grad.detach() * scale
            offset += p.numel()
            hyper = changes[g] if changes else None
            pushes.append(self._client.push(name, grad, priority=-i, hyperparameters=hyper))
        self._settle(pushes)
        self.refresh()

    def _unscale(self, inv_scale: float) -> bool:
        grads = [p.grad for _, p, _ in self._keys if p.grad is not None]
        if self._combined is not None:  # ps-sync, clipped before unscaling
            grads.append(self._combined)
        found = unscale_tensors(grads, inv_scale)
        return self._agree(found) if self.mode == "sync" else found

    def _skip(self) -> None:
        self._combined = None
        if self.mode == "sync":  # every worker skips: nothing to push, nothing changed
            return
        if self.mode == "ssp":
            pushes = [
                self._client.push(name, torch.zeros_like(p), priority=-i, skip=True)
                for i, (name, p, _) in enumerate(self._keys)
            ]
            self._settle(pushes)
        self.refresh()

    # the optimizer state, which lives on the servers -----------------------------

    def _groups(self) -> list[dict[str, Any]]:
        if self.optimizer is not None:
            return self.optimizer.param_groups
        return [{"params": [p for _, p, _ in self._keys]}]  # the servers' own optimizer

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The servers' optimizer state of every parameter, in the single-process
        optimizer's format (hyperparameters from the script's live groups)."""
        key_of = {id(p): name for name, p, _ in self._keys}
        state: dict[int, dict[str, Any]] = {}
        groups: list[dict[str, Any]] = []
        index = 0
        for live in self._groups():
            ids = []
            for p in live["params"]:
                if id(p) in key_of:
                    mine = self._client.optimizer_state(key_of[id(p)], p.detach())
                    if mine:
                        state[index] = mine
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in live.items() if k != "params"}, "params": ids})
        return {"state": state, "param_groups": groups}

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Take a single-process optimizer's state dict (or one this method's peer
        wrote at any world size): hyperparameters into the script's groups (they
        reach the servers with the next push), per-parameter state onto the
        servers (sent by rank 0; a collective: call it on every rank)."""
        live_groups = self._groups()
        saved_groups = state["param_groups"]
        if len(saved_groups) != len(live_groups) or any(
            len(s["params"]) != len(g["params"])
            for s, g in zip(saved_groups, live_groups, strict=True)
        ):
            raise ValueError(
                "the optimizer state dict does not match this optimizer's parameter groups "
                f"({[len(s['params']) for s in saved_groups]} vs "
                f"{[len(g['params']) for g in live_groups]})"
            )
        key_of = {id(p): name for name, p, _ in self._keys}
        per_key: list[tuple[str, torch.Tensor, dict[str, Any]]] = []
        for saved, live in zip(saved_groups, live_groups, strict=True):
            for i, p in zip(saved["params"], live["params"], strict=True):
                if id(p) in key_of:
                    mine = state["state"].get(i, state["state"].get(str(i), {}))
                    per_key.append((key_of[id(p)], p.detach(), mine))

        def send() -> None:
            for name, like, mine in per_key:
                self._client.set_optimizer_state(name, mine, like)

        self._on_rank0(send, "set the optimizer state on the servers")
        if self.optimizer is not None:
            for saved, live in zip(saved_groups, live_groups, strict=True):
                live.update({k: v for k, v in saved.items() if k != "params"})

    def refresh(self) -> None:
        pulls = [
            self._client.pull(name, p.data, priority=-i)
            for i, (name, p, _) in enumerate(self._keys)
        ]
        self._settle(pulls)

    def _settle(self, futures: list[Future[None]]) -> None:
        for f in futures:
            f.result(timeout=self.config.timeout + 5.0)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        super().close()


class AsyncPSStrategy(_PSStrategy):
    """Each push applied on arrival; pulls never wait."""

    name = "ps-async"
    mode = "async"


class SyncPSStrategy(_PSStrategy):
    """One update per round of every worker's push (MXNet dist_sync)."""

    name = "ps-sync"
    mode = "sync"


class SSPPSStrategy(_PSStrategy):
    """Bounded staleness: a worker too far ahead of the slowest waits on pull."""

    name = "ps-ssp"
    mode = "ssp"
