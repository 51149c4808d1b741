"""``servers=``: the shared weights and the outer optimizer on parameter servers.

Without servers every rank holds the shared weights and runs the outer step
on the pseudo-gradients averaged over the job's group. With them
(:class:`OuterServers`), the servers hold the shared weights and each key's
outer optimizer state, and run the outer step; a worker pushes its
pseudo-gradient at its sync and pulls the new shared weights.

Decisions:

- One key per trainable parameter, named as in ``model.named_parameters()``.
  At set-up rank 0 initialises every key with the shared weights (rank 0's)
  and the outer optimizer: the :class:`~gradhub.optim.OptimizerSpec` of what
  ``outer_optimizer`` built, each key with its group's hyperparameters (so it
  must be a ``torch.optim`` class, which a server rebuilds by name: SGD with
  Nesterov momentum is torch's own ``SGD(nesterov=True)`` there). A key the
  servers already hold (a resumed job, servers restored from their
  checkpoint) keeps the servers' value and outer state; every rank then
  pulls the servers' values as its shared weights and its model's.
- ``diloco_mode="sync"`` needs servers in mode ``sync`` that wait for the
  job's world size: at a sync each worker pushes its weighted pseudo-gradient
  divided by the summed weights (the in-process path's 3-float all-reduce,
  blocking here, gives that sum and checks the backward counts first), the
  servers add the round's pushes and step once, and the pull returns once
  that round is applied: the same outer step as without servers, up to the
  order of the sum (two workers' halves add to the in-process mean bit for bit).
- ``diloco_mode="async"`` needs servers in mode ``ssp``: a worker pushes when
  its own sync comes, its pseudo-gradient times its share (``1 / world_size``,
  or the samples it processed over the global samples of those steps when
  ``set_samples`` gave both on every step since its last sync), so that one
  push of every worker moves the weights as one sync would; the servers step
  on each push alone. The pull waits while this worker is more than the
  servers' ``max_staleness`` syncs ahead of the slowest live worker (a
  worker's step on a key is its number of pushes). No collective runs: no
  backward-count check, and buffers stay each worker's own.
- A change of the outer optimizer's hyperparameters (a scheduler on
  :attr:`DiLoCoStrategy.outer`) travels with each key's next push.
- ``compress=`` is the pushes' wire codec; pulls are fp32. A push is
  acknowledged before the pull is sent (a pull must find it counted), and the
  pulls are what :meth:`ServerSync.wait` waits for, so with ``overlap`` the
  outer step and the pull run behind the next inner steps.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch

from gradhub import codecs
from gradhub.errors import DuplicateParameterError, GradhubError, InvalidOptionError
from gradhub.optim import OptimizerSpec
from gradhub.runtime import Runtime
from gradhub.train.strategies.diloco.config import DiLoCoConfig
from gradhub.train.strategies.ps.coordination import on_rank0
from gradhub.train.strategies.ps.discovery import PSConfig, published_addresses
from gradhub.train.strategies.ps.hyper import HyperparameterTracker
from gradhub.train.strategies.ps.servers import connect

SERVER_MODES = {"sync": "sync", "async": "ssp"}
"""The servers' mode for each ``diloco_mode``."""


class ServerSync:
    """One sync's pulls in flight: :meth:`wait` returns once the new shared
    weights are in place."""

    def __init__(self, pulls: list[Future[None]], timeout: float) -> None:
        self._pulls, self._timeout = pulls, timeout

    def wait(self) -> None:
        for future in self._pulls:
            future.result(timeout=self._timeout)
        self._pulls = []


def outer_spec(outer: torch.optim.Optimizer) -> OptimizerSpec:
    """The spec the servers rebuild the outer optimizer from."""
    try:
        return OptimizerSpec.of(outer)
    except TypeError as exc:
        raise InvalidOptionError(
            f"with servers=, outer_optimizer must build a torch.optim optimizer (the "
            f"servers rebuild it by name), got {type(outer).__name__}: {exc}\n- help: e.g. "
            "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)"
        ) from exc


class OuterServers:
    """This worker's client of the servers holding the shared weights ``shared``
    (one key per name in ``names``) and running ``outer`` on them."""

    def __init__(
        self,
        config: DiLoCoConfig,
        runtime: Runtime,
        names: list[str],
        shared: list[torch.Tensor],
        outer: torch.optim.Optimizer,
    ) -> None:
        self.mode = SERVER_MODES[config.diloco_mode]
        self.names, self.shared = names, shared
        self.timeout = config.timeout + 5.0
        spec = outer_spec(outer)
        group_of = {id(p): g for g, grp in enumerate(outer.param_groups) for p in grp["params"]}
        groups = [group_of[id(s)] for s in shared]
        self._hyper = HyperparameterTracker(outer, groups)
        addresses = self._addresses(config, runtime)
        codec = codecs.get(config.compress, for_="diloco")
        ps = PSConfig(
            servers=addresses, secret=config.secret, timeout=config.timeout, compress=codec.name
        )
        self.client, reports = connect(ps, runtime.rank, addresses, self.mode, "diloco")
        try:
            self._check_workers(reports, runtime.world_size)
            specs = [OptimizerSpec(spec.name, (spec.groups[g],)) for g in groups]

            def init() -> int:
                for key, value, key_spec in zip(names, shared, specs, strict=True):
                    try:
                        self.client.init(key, value, optimizer=key_spec)
                    except DuplicateParameterError:
                        continue  # kept: the servers' value and outer state win
                return 0

            on_rank0(runtime, init, "initialise the shared weights on the servers", "diloco")
            self.pull(range(len(names))).wait()
        except BaseException:
            self.client.close(timeout=0)
            raise

    @staticmethod
    def _addresses(config: DiLoCoConfig, runtime: Runtime) -> list[str]:
        if isinstance(config.servers, list):
            return list(config.servers)
        found = published_addresses(min(10.0, runtime.timeout))
        if not found:
            raise GradhubError(
                "strategy 'diloco' was given servers=True and no parameter servers were "
                "published\n- help: launch with `gradhub run -n N --servers S --ps-mode "
                "sync script.py` (--ps-mode ssp --max-staleness K for diloco_mode='async'), "
                "or pass servers=['tcp://HOST:PORT', ...] (started with `gradhub serve`)"
            )
        return found

    def _check_workers(self, reports: list[dict[str, Any]], world: int) -> None:
        counts = {int(r.get("workers", 0)) for r in reports}
        if self.mode == "sync" and counts != {world}:
            raise GradhubError(
                f"strategy 'diloco' runs {world} workers, but the servers' sync rounds wait "
                f"for {', '.join(map(str, sorted(counts)))}\n- help: start them with "
                f"--workers {world} (gradhub run sets it to the job's world size)"
            )

    def push(self, members: range, deltas: list[torch.Tensor]) -> None:
        """Push each member's (scaled) pseudo-gradient; returns once every push is
        acknowledged (the tensors may be written again)."""
        self._hyper.begin_step()
        pushes = [
            self.client.push(
                self.names[i], delta, priority=-i, hyperparameters=self._hyper.for_push(i)
            )
            for i, delta in zip(members, deltas, strict=True)
        ]
        for future in pushes:
            future.result(timeout=self.timeout)

    def pull(self, members: range) -> ServerSync:
        """Start pulling the members' shared weights (into :attr:`shared`)."""
        pulls = [self.client.pull(self.names[i], self.shared[i], priority=-i) for i in members]
        return ServerSync(pulls, self.timeout)

    def steps(self) -> dict[str, dict[int, int]]:
        """The servers' count of each worker's pushes per key (their reports)."""
        out: dict[str, dict[int, int]] = {}
        for report in self.client.stats():
            for key, per_worker in report.get("steps", {}).items():
                name = key.split("[slice ")[0]  # a sliced key counts as its largest slice
                known = out.setdefault(name, {})
                for worker, n in per_worker.items():
                    known[int(worker)] = max(known.get(int(worker), 0), int(n))
        return out

    def close(self) -> None:
        self.client.close()


__all__ = ["SERVER_MODES", "OuterServers", "ServerSync", "outer_spec"]
