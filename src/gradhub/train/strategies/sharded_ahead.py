"""``sharded``'s update taken during the backward, aside, and kept by ``step()``.

In the usual loop (``backward()``, then ``optimizer.step()`` with ``.grad``
left alone in between) the slice step and the weight all-gather need nothing
the backward has not made already: once a bucket's sums have landed, its
pieces of this rank's slice can be stepped and their new values all-gathered
while earlier blocks are still in their backward. :class:`StepAhead` does
that on the group's worker, right behind each bucket's gradient all-gather,
and aside: into a second flat weight vector and a copy of each stepped
piece's optimizer state. The model's weights, the optimizer's state and
what a state-dict request reads stay the step before's until ``step()``
keeps the work (the parameters then view the other vector: nothing is
copied), after checking that it is what ``step()`` would compute now:

- every parameter was used on some rank (one that no rank used is not
  stepped at all);
- every ``.grad`` is still the combined gradient the backward left (the
  same tensor, not written since: torch's version counters), and no
  parameter was written since either (``clip_grad_norm_``, ``unscale_``,
  ``zero_grad`` or a hand-made change all show);
- the script's parameter groups hold the hyperparameters the work used (an
  LR changed between backward and step shows);
- no state was loaded since.

Every rank must decide alike (the next collectives depend on it), so the
ranks agree with one small all-reduce of the answer. Work not kept is
dropped and ``step()`` steps and gathers as without it, so the bits are the
same either way: the optimizers taken (:data:`.ELEMENTWISE`) update each
tensor on its own, so stepping the pieces bucket by bucket equals one step
of them all. After a step whose work was dropped the work pauses for 1,
2, 4, ... up to 1024 steps (a loop that clips or unscales every step soon
stops paying for it). A backward with no ``step()`` after it (a step a
scaler skipped) leaves the work unkept; the next backward drops it.

Memory: one more fp32 vector of the weights' size per rank. Taken only
where the master is the weights' own slice (fp32 parameters, no wire codec),
in host memory (on a CUDA device the worker's kernels would need ordering
with the backward's stream: not taken there yet), with the buckets started
from the backward hooks and the sums gathered during the backward (not
``set_samples(n)`` alone), outside a surviving job (its mirrors step beside
the owner at ``step()``).
"""

from __future__ import annotations

from typing import Any

import torch

from gradhub import codecs
from gradhub.collective import AllReduceParameter, CollectiveFuture, CollectiveGroup, all_reduce
from gradhub.collective.collectives import run_all_gather
from gradhub.collective.sharded_optimizer import ShardedOptimizer
from gradhub.partition import segment_ranges
from gradhub.runtime import Runtime

_LONGEST_PAUSE = 1024
_PLAIN = codecs.NoCompression()


class StepAhead:
    """The slice step and weight all-gather of each bucket, taken aside during backward."""

    def __init__(
        self,
        opt: ShardedOptimizer,
        arp: AllReduceParameter,
        group: CollectiveGroup,
        params: list[torch.nn.Parameter],
    ) -> None:
        self._opt, self._arp, self._group, self._params = opt, arp, group, params
        self.weights = arp.flat_weights
        """The flat weights the parameters view now."""
        self._spare = torch.empty_like(self.weights)
        self._start, self._length = arp.local_partition_range
        self._offsets = [0]
        for p in params:
            self._offsets.append(self._offsets[-1] + p.numel())
        self._taking = False  # this backward's update is being taken aside
        self._futures: list[CollectiveFuture[Any]] = []
        self._aside: dict[int, dict[str, Any] | None] = {}  # piece number -> its new state
        self._states: dict[int, dict[str, Any] | None] = {}  # piece number -> its state then
        self._buckets = 0  # buckets taken aside in this backward
        self._hyper: list[dict[str, Any]] = []
        self._seen: list[tuple[torch.Tensor | None, int, int]] = []
        self._valid = False
        self._pause = self._backoff = 0
        self.kept = 0
        """How many steps kept the update taken during their backward."""
        self._flag = torch.zeros(1)  # the agreement's all-reduce, read in host memory
        self._flag_host = self._flag.numpy()

    @classmethod
    def made(
        cls,
        opt: ShardedOptimizer,
        arp: AllReduceParameter,
        runtime: Runtime,
        params: list[torch.nn.Parameter],
        wanted: bool,
    ) -> StepAhead | None:
        """One where it is ``wanted`` and can be taken (see the module docstring):
        the master is the fp32 weights' own slice in host memory, more than one rank."""
        plain = isinstance(arp.codec, codecs.NoCompression)
        fits = plain and arp.device.type == "cpu" and runtime.world_size > 1
        if not (wanted and fits):
            return None
        return cls(opt, arp, runtime.group, params)

    def begin(self, live_groups: list[dict[str, Any]], *, wanted: bool) -> None:
        """A synchronising backward starts: take its update aside if ``wanted``
        (the sums are gathered during it) and not paused; every rank decides
        alike (only agreed outcomes count)."""
        self._taking, self._futures, self._buckets = False, [], 0
        self._aside, self._states = {}, {}
        if not wanted or any(isinstance(v, torch.Tensor) for g in live_groups for v in g.values()):
            return
        if self._pause:
            self._pause -= 1
            return
        self._hyper = [_hyperparameters(g) for g in live_groups]
        for mine, live in zip(self._opt.param_groups, self._hyper, strict=True):
            mine.update(live)
        self._taking = True

    def bucket(self, offset: int, n: int) -> None:
        """Queue, behind the bucket's gradient all-gather, its pieces' step and
        the all-gather of its new weights, both into the spare vector."""
        if not self._taking:
            return
        self._buckets += 1
        opt, group, aside, states = self._opt, self._group, self._aside, self._states
        numbers = [
            i
            for i, piece in enumerate(opt.pieces)
            if offset <= self._start + piece.start < offset + n
        ]
        ranges = segment_ranges(self._arp.size, group.world_size, offset, n)
        here, length = ranges[group.rank]
        mine = slice(offset + here, offset + here + length)
        spare, weights = self._spare, self.weights
        gradients = self._arp.gradient_partition
        timeout = self._arp.timeout

        def body() -> Any:
            spare[mine].copy_(weights[mine])
            _step_aside(opt, numbers, spare, gradients, self._start, aside, states)
            return run_all_gather(
                group,
                spare[mine],
                n,
                _PLAIN,
                out=spare[offset : offset + n],
                timeout=timeout,
                name="weights all_gather (during backward)",
                ranges=ranges,
            )

        self._futures.append(group.submit("weights all_gather (during backward)", body))

    def backward_done(self, all_used: bool, buckets: int) -> None:
        """The backward ended (every parameter used on some rank: ``all_used``; the
        vector in ``buckets`` buckets): note what ``step()`` must find unchanged."""
        if not self._taking:
            return
        self._valid = all_used and self._buckets == buckets
        self._seen = [
            (p.grad, -1 if p.grad is None else p.grad._version, p._version) for p in self._params
        ]

    def keep(self, live_groups: list[dict[str, Any]]) -> bool:
        """``step()``: keep the update taken aside if every rank may (True), or drop it."""
        if not self._taking:
            return False
        self._taking = False
        valid = self._valid and self._unchanged(live_groups)
        for future in self._futures:  # the last buckets' work may still run
            future.wait()
        if valid:  # before the agreement: a peer past it reads this step's state here
            with self._opt.lock:
                self._swap(self._aside)
                self._opt.steps += 1
        self._flag_host[0] = 0.0 if valid else 1.0
        all_reduce(self._flag, group=self._group).wait()
        if self._flag_host[0] == 0:
            self._backoff = 0
            self.kept += 1
            return True
        if valid:  # another rank may not keep it: back to the step before
            with self._opt.lock:
                self._swap(self._states)
                self._opt.steps -= 1
        self._backoff = min(max(1, 2 * self._backoff), _LONGEST_PAUSE)
        self._pause = self._backoff
        return False

    def gather(self) -> CollectiveFuture[Any]:
        """All-gather every rank's slice of :attr:`weights` in place (``step()``
        without work kept)."""
        group, weights, size = self._group, self.weights, self._arp.size
        own = weights[self._start : self._start + self._length]
        timeout = self._arp.timeout
        return group.submit(
            "get_weights",
            lambda: run_all_gather(
                group, own, size, _PLAIN, out=weights, timeout=timeout, name="get_weights"
            ),
        )

    def _unchanged(self, live_groups: list[dict[str, Any]]) -> bool:
        if [_hyperparameters(g) for g in live_groups] != self._hyper:
            return False
        state = self._opt.optimizer.state
        pieces = self._opt.pieces
        if any(state.get(pieces[i].view) is not s for i, s in self._states.items()):
            return False  # loaded since
        return all(
            p.grad is grad and (grad is None or grad._version == version) and p._version == pv
            for p, (grad, version, pv) in zip(self._params, self._seen, strict=True)
        )

    def _swap(self, states: dict[int, dict[str, Any] | None]) -> None:
        """The parameters and the pieces view the spare vector, the pieces hold
        ``states`` (by piece number), the two vectors trade names (under the
        optimizer's lock)."""
        opt, spare = self._opt, self._spare
        for i, piece in enumerate(opt.pieces):
            start = self._start + piece.start
            piece.view.data = spare[start : start + piece.view.numel()]
            opt.optimizer.state.pop(piece.view, None)
            state = states.get(i)
            if state is not None:
                opt.optimizer.state[piece.view] = state
        for p, a, b in zip(self._params, self._offsets, self._offsets[1:], strict=False):
            p.data = spare[a:b].view_as(p)
        self.weights, self._spare = spare, self.weights


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def _step_aside(
    opt: ShardedOptimizer,
    numbers: list[int],
    spare: torch.Tensor,
    gradients: torch.Tensor,
    start: int,
    aside: dict[int, dict[str, Any] | None],
    states: dict[int, dict[str, Any] | None],
) -> None:
    """Step pieces ``numbers`` into ``spare`` with copies of their state (the new
    state kept in ``aside``, the state stepped from in ``states``); the pieces
    and the optimizer's state are as before afterwards."""
    state = opt.optimizer.state
    with opt.lock:
        originals: dict[int, tuple[torch.Tensor, dict[str, Any] | None]] = {}
        try:
            for i in numbers:
                piece = opt.pieces[i]
                n = piece.view.numel()
                original = states[i] = state.pop(piece.view, None)
                originals[i] = (piece.view.data, original)
                if original is not None:
                    state[piece.view] = _copied(original)
                piece.view.data = spare[start + piece.start : start + piece.start + n]
                piece.view.grad = gradients[piece.start : piece.start + n]
            opt.optimizer.step()
        finally:
            for i, (data, original) in originals.items():
                piece = opt.pieces[i]
                piece.view.grad = None
                piece.view.data = data
                aside[i] = state.pop(piece.view, None)
                if original is not None:
                    state[piece.view] = original


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}
