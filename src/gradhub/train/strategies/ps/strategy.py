"""The ``ps-*`` strategies: one worker's side of training against parameter servers
(what each promises: :mod:`gradhub.train.strategies.ps`; the pieces: :mod:`.servers`,
:mod:`.hyper`, :mod:`.state`, :mod:`.coordination`, :mod:`.surviving`)."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from gradhub._config import config_or_options
from gradhub.collective import all_reduce
from gradhub.errors import GradhubError, StateError
from gradhub.optim import OptimizerSpec
from gradhub.train.strategies.base import Strategy
from gradhub.train.strategies.ps.coordination import broadcast_json, on_rank0
from gradhub.train.strategies.ps.discovery import PSConfig, published_addresses
from gradhub.train.strategies.ps.hyper import HyperparameterTracker
from gradhub.train.strategies.ps.servers import (
    Key,
    connect,
    init_keys,
    latest_generation,
    new_generation,
    wire_name,
)
from gradhub.train.strategies.ps.state import fetch as fetch_state
from gradhub.train.strategies.ps.state import load_hyperparameters, local_state, per_key
from gradhub.train.strategies.ps.surviving import settle, share_buffers, tell_members
from gradhub.train.strategies.step_flags import StepFlags

if TYPE_CHECKING:
    from gradhub.runtime.membership import Regrouped

log = logging.getLogger(__name__)


class _PSStrategy(Strategy):
    mode: ClassVar[str]
    needs_optimizer = False
    state_outlives_workers = True
    survives = True

    def __init__(self, config: PSConfig | None = None, **options: Any) -> None:
        super().__init__()
        self.config = config_or_options(PSConfig, config, options)
        self._client: Any = None
        self._keys: list[Key] = []
        self._by_id: dict[int, Key] = {}
        self._generation = 0
        self._spec: OptimizerSpec | None = None
        self._hyper = HyperparameterTracker(None, [])
        self._flags: StepFlags | None = None
        self._device = torch.device("cpu")
        self._staging: list[torch.Tensor] = []  # a surviving ps-sync step's pulls

    # set-up -----------------------------------------------------------------------

    def _setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        rt = self.runtime
        self._spec = OptimizerSpec.of(optimizer) if optimizer is not None else None
        addresses = self.config.servers or published_addresses(min(10.0, rt.timeout))
        if not addresses:
            raise GradhubError(
                f"strategy {self.name!r} needs parameter servers and none were given\n"
                "- help: launch with `gradhub run -n N --servers S script.py`, or pass "
                "servers=['tcp://HOST:PORT', ...] (started with `gradhub serve`)"
            )
        group_of: dict[int, int] = {}
        if optimizer is not None:
            group_of = {
                id(p): g for g, grp in enumerate(optimizer.param_groups) for p in grp["params"]
            }
        trainable = {id(p) for p in self.params}
        self._keys = [
            Key(n, p, group_of.get(id(p), 0))
            for n, p in model.named_parameters()
            if id(p) in trainable
        ]
        self._by_id = {id(k.param): k for k in self._keys}
        self._flags = StepFlags(len(self._keys), rt.group)
        self._device = self.params[0].device
        self._hyper = HyperparameterTracker(optimizer, [k.group for k in self._keys])
        # Rank 0's parameters (frozen ones too) and buffers everywhere first.
        self._broadcast_from_rank0(model)
        worker = rt.rank if rt.membership is None else rt.membership.member  # kept by regroups
        self._client, reports = connect(self.config, worker, addresses, self.mode, self.name)
        try:
            local = {} if optimizer is None else local_state(optimizer)

            def init() -> int:
                generation = latest_generation(reports, self._keys)
                self._set_generation(generation)
                init_keys(self._client, self._keys, self._spec, local)
                return generation

            if rt.joined is not None:  # a replacement: the keys are there, in use
                self._set_generation(latest_generation(reports, self._keys))
                tell_members(rt, self._client, rt.joined, self.name)  # as the survivors do
            else:
                self._set_generation(
                    on_rank0(rt, init, "initialise the parameters on the servers", self.name)
                )
            if optimizer is not None:
                optimizer.state.clear()  # it lives on the servers from now on
            if rt.restart and rt.joined is None and self.mode != "async":
                self._align_steps()
        except Exception:
            self._client.close(timeout=0)
            raise
        self.refresh()

    def _set_generation(self, generation: int) -> None:
        self._generation = generation
        for key in self._keys:
            key.wire = wire_name(key.name, generation)

    def _wire_of(self, p: torch.Tensor) -> str | None:
        key = self._by_id.get(id(p))
        return None if key is None else key.wire

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
        none has pushed, and tells every rank its pads (a bounded broadcast);
        every rank pads its own.
        """
        rt = self.runtime
        plan: dict[str, dict[str, int]] = {}
        if rt.is_main:
            steps: dict[str, dict[int, int]] = {}
            for report in self._client.stats():
                for key, per_worker in report.get("steps", {}).items():
                    name = key.split("[slice ")[0]  # a sliced key counts as its largest slice
                    known = steps.setdefault(name, {})
                    for w, n in per_worker.items():
                        known[int(w)] = max(known.get(int(w), 0), int(n))
            plan = {
                str(rank): {
                    name: max(by.values()) - by.get(rank, 0)
                    for name, by in steps.items()
                    if max(by.values()) > by.get(rank, 0)
                }
                for rank in range(rt.world_size)
            }
        plan = broadcast_json(rt, plan, f"restart of {self.name}: aligning the workers' steps")
        mine = plan.get(str(rt.rank), {})
        pushes = [
            self._client.push(key.wire, torch.zeros_like(key.param), priority=-i)
            for i, key in enumerate(self._keys)
            for _ in range(mine.get(key.wire, 0))
        ]
        self._settle(pushes)
        if mine:
            log.info(
                "[rank %d] restart: %d zero push(es) to catch up with the other workers' steps",
                rt.rank,
                len(pushes),
            )

    # backward and step ------------------------------------------------------------

    def _finish_backward(self) -> None:
        if self.mode == "sync":
            self._combine()

    def _combine(self) -> None:
        """ps-sync: every ``p.grad`` becomes the combined gradient, the same bits on
        every worker: one all-reduce per dtype (float32 on the job's transport,
        shared memory on one host; others through the backend), the float32 one
        carrying a flag per parameter saying whether any worker used it."""
        weight, by_count = self._weights()
        grads = [key.param.grad for key in self._keys]
        used_here = self._used  # accumulated since the last sync, no_sync steps included
        flags = self._flags
        assert flags is not None
        used_now = [id(k.param) in used_here for k in self._keys]
        flags.write(used_now, weight if by_count else 0, self._joining())
        counted = flags.launch()  # host memory: nothing read back from a device
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, key in enumerate(self._keys):
            by_dtype.setdefault(key.param.dtype, []).append(i)
        where = f"step {self.steps} of strategy {self.name!r}: combining the gradients"
        combined: dict[int, torch.Tensor] = {}
        for dtype, members in by_dtype.items():
            flat = torch.cat(
                [
                    torch.zeros(self._keys[i].param.numel(), dtype=dtype, device=self._device)
                    if grads[i] is None
                    else grads[i].detach().reshape(-1).to(dtype) * weight  # type: ignore[union-attr]
                    for i in members
                ]
            )
            try:
                if dtype == torch.float32:  # the job's transport (shared memory on one host)
                    all_reduce(flat, group=self.runtime.group).wait()
                else:
                    self.runtime.all_reduce_sum(flat, where=where)
            except StateError:  # the group broke in the flags' sum: raise what broke it
                if counted is not None:
                    counted.wait()
                raise
            offset = 0
            for i in members:
                n = self._keys[i].param.numel()
                combined[i] = flat[offset : offset + n]
                offset += n
        used, summed = flags.read(None if counted is None else counted.wait)
        self._regroup_after = self.runtime.survive and flags.regroup()
        total = summed if by_count else 1.0
        for i, key in enumerate(self._keys):
            p = key.param
            if not used[i]:  # no worker used it: .grad stays as it was (None after
                continue  # zero_grad), as under DDP(find_unused_parameters=True)
            value = combined[i].view_as(p)
            if by_count:
                value = value / total
            if p.grad is not None and p.grad.shape == p.shape:
                p.grad.copy_(value)
            else:
                p.grad = value.to(p.dtype).clone()

    def _apply(self) -> None:
        self._hyper.begin_step()
        pushes = self._push_shares() if self.mode == "sync" else self._push_own()
        self._settle(pushes)
        if not self.runtime.survive:
            self.refresh()
        elif self.mode == "sync":
            self._pull_staged()  # the parameters change once every key came back
        else:
            self._end_step()
            self.refresh()

    def _end_step(self) -> None:
        """A surviving ps-async/ssp step commits once every worker's pushes were
        accepted (see :mod:`.surviving`): one all-reduce on the job's transport,
        which sees a peer that died before it entered, of whether a rank saw a
        replacement ready (every rank then regroups after this step)."""
        joining = torch.tensor([float(self._joining())])  # host memory: read there
        all_reduce(joining, group=self.runtime.group).wait()
        self._regroup_after = bool(joining.numpy()[0] > 0)

    def _step_done(self) -> None:
        super()._step_done()
        self._after_step()  # a step a scaler skipped too: it has no other end

    def _pull_staged(self) -> None:
        """A surviving ps-sync step: pull every key aside, then into the parameters."""
        if not self._staging:
            self._staging = [torch.empty_like(key.param.data) for key in self._keys]
        pulls = [
            self._client.pull(key.wire, into, priority=-i)
            for i, (key, into) in enumerate(zip(self._keys, self._staging, strict=True))
        ]
        self._settle(pulls)
        with torch.no_grad():
            for key, pulled in zip(self._keys, self._staging, strict=True):
                key.param.data.copy_(pulled)

    def _rebind(self) -> None:
        self._flags = StepFlags(len(self._keys), self.runtime.group)

    def _regrouped(self, done: Regrouped) -> None:
        """After a regroup: the servers learn the new membership (from the new rank
        0; see :mod:`.surviving`); a rank behind, and every ps-async/ssp worker,
        pulls the servers' values. A ps-sync worker that is not behind keeps the
        values its failed step started from: the redo's gradient is taken there."""
        self._rebind()
        self._staging = []  # a late answer to the failed step's pulls lands in the old ones
        tell_members(self.runtime, self._client, done, self.name)
        share_buffers(self.runtime, self.model, done)
        if self.mode != "sync" or self.runtime.rank in done.behind:
            self.refresh()

    def _set_up_joined(self) -> None:
        """A replacement took the servers' values in ``_setup``; the buffers (a
        broadcast its peers' :meth:`_regrouped` make too) come from the survivors."""
        done, self.runtime.joined = self.runtime.joined, None
        if done is not None:
            share_buffers(self.runtime, self.model, done)

    def _apply_unsynced(self) -> None:
        """``step`` with no backward since the last step: as DDP's optimizer steps
        again on what ``.grad`` holds, the servers get it again (``ps-sync``:
        the last combined gradient, the same bits on every worker; a key whose
        ``.grad`` is None, after ``zero_grad``, is not pushed)."""
        self._apply()

    def _push_shares(self) -> list[Future[None]]:
        """ps-sync: ``p.grad`` is the combined gradient on every worker. Key ``i`` is
        pushed whole by worker ``i % world_size`` and as zeros by the others, so the
        round's sum on the servers is that gradient, bit for bit. A key whose
        ``.grad`` is None (no worker used it, agreed in backward) is not pushed."""
        rt = self.runtime
        tag = self._tag()
        pushes = []
        for i, key in enumerate(self._keys):
            g = key.param.grad
            if g is None:
                continue
            share = g.detach() if i % rt.world_size == rt.rank else torch.zeros_like(g)
            hyper = self._hyper.for_push(i)
            pushes.append(
                self._client.push(key.wire, share, priority=-i, hyperparameters=hyper, step=tag)
            )
        return pushes

    def _push_own(self) -> list[Future[None]]:
        """ps-async/ps-ssp: this worker's gradient times its share. A parameter this
        worker did not use (``.grad`` None) is not moved by its update: nothing is
        pushed (async), or a skip push that moves this worker's clock (ssp; and
        async in a surviving job, where a step of a key waits for every worker's
        push: see :mod:`.surviving`)."""
        scale = self._scale()
        tag = self._tag()
        pushes = []
        for i, key in enumerate(self._keys):
            g = key.param.grad
            hyper = self._hyper.for_push(i)
            if g is not None:
                grad = g.detach() * scale
                pushes.append(
                    self._client.push(key.wire, grad, priority=-i, hyperparameters=hyper, step=tag)
                )
            elif self.mode == "ssp" or tag is not None:
                zeros = torch.zeros_like(key.param)
                pushes.append(
                    self._client.push(
                        key.wire, zeros, priority=-i, hyperparameters=hyper, skip=True, step=tag
                    )
                )
        return pushes

    def _tag(self) -> tuple[int, int] | None:
        """A surviving job's tag of this step's pushes: the job's step (its committed
        steps) and membership generation (see :mod:`.surviving`)."""
        rt = self.runtime
        return (rt.committed_steps, rt.generation) if rt.survive else None

    def _scale(self) -> float:
        scale, by_count = self._weights()
        if by_count:
            total = self.runtime.all_reduce_sum(torch.tensor([scale]), where="sample count")
            scale = scale / float(total[0])
        return scale

    def _skip(self) -> None:
        if self.mode == "sync":  # every worker skips: nothing to push, nothing changed
            return
        tag = self._tag()  # a surviving job's step of a key waits for every worker's push
        if self.mode == "ssp" or tag is not None:
            pushes = [
                self._client.push(
                    key.wire, torch.zeros_like(key.param), priority=-i, skip=True, step=tag
                )
                for i, key in enumerate(self._keys)
            ]
            self._settle(pushes)
        if tag is not None:  # as _apply's step end: a scaler may skip on one worker only
            self._end_step()
        self.refresh()

    # checkpoints ------------------------------------------------------------------

    def _groups(self) -> list[dict[str, Any]]:
        if self.optimizer is not None:
            return self.optimizer.param_groups
        return [{"params": [key.param for key in self._keys]}]  # the servers' own optimizer

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The servers' optimizer state of every parameter, in the single-process
        optimizer's format; no collective (see :mod:`.state`)."""
        return fetch_state(self._client, self._groups(), self._wire_of)

    def load_optimizer_state_dict(self, saved: dict[str, Any]) -> None:
        """A single-process optimizer's state dict (or one this method's peer wrote
        at any world size) into the servers and the script's groups; every rank
        calls it (see :mod:`.state`)."""
        groups = self._groups()
        entries = per_key(saved, groups, self._wire_of)

        def send() -> int:
            for wire, like, mine in entries:
                self._client.set_optimizer_state(wire, mine, like)
            return 0

        on_rank0(self.runtime, send, "set the optimizer state on the servers", self.name)
        if self.optimizer is not None:
            load_hyperparameters(saved, groups)

    def model_loaded(self) -> None:
        """Every rank loaded a state dict into the model: rank 0's values become a
        new generation of keys on the servers (see :mod:`.servers`)."""
        rt = self.runtime

        def renew() -> int:
            return new_generation(self._client, self._keys, self._generation, self._spec)

        self._set_generation(on_rank0(rt, renew, "store the loaded parameters", self.name))
        self._hyper.reset()
        self.refresh()

    def refresh(self) -> None:
        pulls = [
            self._client.pull(key.wire, key.param.data, priority=-i)
            for i, key in enumerate(self._keys)
        ]
        self._settle(pulls)

    def _settle(self, futures: list[Future[None]]) -> None:
        where = f"step {self.steps} of strategy {self.name!r}"
        settle(futures, self.config.timeout + 5.0, self.runtime.membership, where)

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
