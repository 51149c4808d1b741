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
- The trainer's local optimizer is not used: the servers' optimizer is
  (``gradhub run --ps-optimizer/--ps-lr`` or ``gradhub serve``).
- Model buffers (e.g. batch-norm statistics) stay local to each worker.
"""

from __future__ import annotations

import contextlib
import json
import os
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from gradhub.errors import DuplicateParameterError, GradhubError, GradhubTimeoutError
from gradhub.train.strategies.base import Closure, Strategy

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
    codec: str = "none"
    """Wire codec for gradients (``"none"``, ``"fp16"``, ``"bf16"``, ...)."""

    def __post_init__(self) -> None:
        if isinstance(self.servers, str):
            self.servers = [self.servers]
        if self.servers is not None and not self.servers:
            raise ValueError("servers is an empty list; give at least one address or None")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")


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

    def __init__(self, config: PSConfig | None = None, **options: Any) -> None:
        super().__init__()
        if config is not None and options:
            raise TypeError("pass either config= or keyword options, not both")
        self.config = config or PSConfig(**options)
        self._client: Any = None
        self._params: list[tuple[str, torch.nn.Parameter]] = []

    def _setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        from gradhub.ps.remote import RemoteParameterServer

        rt = self.runtime
        addresses = self.config.servers or published_addresses(min(10.0, rt.timeout))
        if not addresses:
            raise GradhubError(
                f"strategy {self.name!r} needs parameter servers and none were given\n"
                "- help: launch with `gradhub run -n N --servers S script.py`, or pass "
                "servers=['tcp://HOST:PORT', ...] (started with `gradhub serve`)"
            )
        self._params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._client = RemoteParameterServer(
            addresses,
            worker_id=rt.rank,
            secret=self.config.secret,
            timeout=self.config.timeout,
            codec=self.config.codec,
        )
        try:
            reports = self._client.stats()
        except GradhubTimeoutError as exc:
            self._client.close(timeout=0)
            raise GradhubError(
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
        if rt.is_main:
            for name, p in self._params:
                # A key restored or kept by the servers keeps their value.
                with contextlib.suppress(DuplicateParameterError):
                    self._client.init(name, p.detach())
        rt.all_reduce_sum(torch.zeros(1), where="parameter-server set-up")  # keys are in
        self.refresh()

    def step(self, closure: Closure, samples: int, global_samples: int) -> None:
        self._check_counts(samples, global_samples)
        for _, p in self._params:
            p.grad = None
        if samples > 0:
            closure().backward()
        scale = samples / global_samples
        pushes: list[Future[None]] = []
        for i, (name, p) in enumerate(self._params):
            grad = torch.zeros_like(p) if p.grad is None else p.grad.detach() * scale
            pushes.append(self._client.push(name, grad, priority=-i))
        self._settle(pushes)
        self.refresh()
        self.steps += 1

    def refresh(self) -> None:
        pulls = [
            self._client.pull(name, p.data, priority=-i) for i, (name, p) in enumerate(self._params)
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
