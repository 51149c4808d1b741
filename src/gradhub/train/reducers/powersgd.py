"""PowerSGD: low-rank gradient compression for all-reduce (Vogels et al., NeurIPS 2019).

A bucket reducer: :meth:`PowerSGD.reduce` sums one flat gradient bucket over
the ranks of a process group *in place*, as a plain all-reduce would, but
sends far fewer bytes. Every tensor of the bucket that is a matrix (``n x m``
once viewed as ``shape[0] x rest``) and worth compressing is replaced by a
rank-``r`` approximation built with one step of power iteration:

1. ``M = G + E``: this rank's gradient plus its error feedback (what earlier
   approximations left out);
2. ``P = M Q`` with ``Q`` (``m x r``) kept from the previous step (warm
   start; at first a random matrix drawn from a seed every rank shares), and
   **all-reduce** ``P`` (``n x r`` per matrix, all matrices in one message,
   together with the bucket's small tensors, which are sent uncompressed);
3. orthonormalise the columns of the summed ``P`` (Gram-Schmidt);
4. ``Q = M^T P`` and **all-reduce** ``Q`` (``m x r`` per matrix, one message);
5. the result is ``P Q^T`` (the sum of every rank's ``M``, approximated), and
   ``E = M - P Q^T / world_size`` is kept for the next step: the ranks'
   errors add up to what the result left out, ``sum(M) - P Q^T``.

Two all-reduces per bucket carrying ``(n + m) r`` numbers per matrix instead
of ``n m``. The bucket's gradients arrive already scaled by each rank's share
of the batch, so the sum is the average and no division is needed.

The all-reduces are fp32 sums. With ``collective=`` (a
:class:`~gradhub.collective.CollectiveGroup`; the ``allreduce`` strategy
passes the job's) they are :func:`gradhub.collective.all_reduce` on its
transport (shared memory on one host, the hierarchical path across hosts);
else the backend's own ``all_reduce`` on ``group``.

Every rank ends with the same bits: both all-reduces hand every rank the same
sum, and what is computed from them (orthonormalisation, ``P Q^T``) is the
same deterministic arithmetic on the same inputs, in a fixed order (tensors in
bucket order). Only ``E`` differs between ranks, as it should.

Decisions (where the paper and torch's ``powerSGD_hook`` leave a choice):

- ``rank=1`` and ``min_compression_rate=2`` by default, as torch's hook; a
  matrix is compressed only when ``(n + m) * rank * min_compression_rate <
  n * m``. 1-D tensors (biases, norms) are all-reduced exactly.
- ``start_step=0``: compression from the first step, as in the paper (torch's
  hook defaults to 1000 full-precision steps); steps before ``start_step``
  all-reduce the whole bucket exactly and leave no error behind.
- Elements at the end of the bucket beyond the tensors in ``shapes`` (e.g. a
  sample count riding along) are all-reduced exactly.
- A bucket must keep its layout from step to step (the error and ``Q`` are
  kept per bucket); a different layout for a known ``bucket_index`` is a
  ``ValueError``.
- Columns of ``P`` that are all zero (a matrix whose gradient is zero) stay
  zero instead of becoming NaN.
- A step a loss scaler skipped (its gradient held inf or NaN, every rank
  skips it) left inf or NaN in the error and ``Q``: :meth:`PowerSGD.step_skipped`
  drops both, and the next step starts as the first did (no error, ``Q``
  from the shared seed), the same on every rank.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gradhub._config import config_or_options
from gradhub.collective import CollectiveGroup, all_reduce
from gradhub.errors import CollectiveTimeoutError, InvalidOptionError, WorkerFailedError

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class PowerSGDConfig:
    """Settings of :class:`PowerSGD`."""

    rank: int = 1
    """Rank ``r`` of the approximation: more is more accurate and sends more."""
    start_step: int = 0
    """Steps before this one all-reduce the full-precision bucket."""
    min_compression_rate: float = 2.0
    """Compress a matrix only if this saves at least this factor of its bytes."""
    error_feedback: bool = True
    """Carry what each approximation leaves out into the next step."""
    warm_start: bool = True
    """Start each step's power iteration from the previous step's ``Q``."""
    seed: int = 0
    """Seed of the first ``Q`` (the same on every rank)."""
    timeout: float = 300.0
    """Seconds each all-reduce may take before :class:`CollectiveTimeoutError`."""

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise InvalidOptionError(f"rank must be an integer >= 1, got {self.rank!r}")
        if self.start_step < 0:
            raise InvalidOptionError(f"start_step must be >= 0, got {self.start_step}")
        if not self.min_compression_rate >= 1:
            raise InvalidOptionError(
                f"min_compression_rate must be >= 1, got {self.min_compression_rate}"
            )
        if not self.timeout > 0:
            raise InvalidOptionError(f"timeout must be > 0 seconds, got {self.timeout}")


@dataclass
class _Matrix:
    offset: int
    rows: int
    cols: int
    rank: int


@dataclass
class _BucketState:
    shapes: list[torch.Size]
    matrices: list[_Matrix]
    exact: list[tuple[int, int]]  # (offset, length) of slices all-reduced exactly
    error: torch.Tensor | None = None
    qs: list[torch.Tensor] = field(default_factory=list)


def orthonormalize_(p: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Gram-Schmidt on the columns of ``p`` (``n x r``), in place; zero columns stay zero."""
    for i in range(p.shape[1]):
        col = p[:, i]
        for j in range(i):
            prev = p[:, j]
            col.sub_(torch.dot(prev, col) * prev)
        norm = torch.linalg.vector_norm(col)
        if norm > eps:
            col.div_(norm)
        else:
            col.zero_()
    return p


class PowerSGD:
    """Reduces flat gradient buckets with PowerSGD over ``collective`` when given,
    else over ``group`` (default: the default group).

    Without either and without an initialised process group it runs as a
    world of one (the compression still applies; tests and single-process
    references use this).
    """

    name = "powersgd"

    def __init__(
        self,
        config: PowerSGDConfig | None = None,
        *,
        group: dist.ProcessGroup | None = None,
        collective: CollectiveGroup | None = None,
        **options: Any,
    ) -> None:
        self.config = config_or_options(PowerSGDConfig, config, options)
        self.group = group
        self.collective = collective
        self._buckets: dict[int, _BucketState] = {}
        self._pending: dict[int, dict[str, Any]] = {}
        self.bytes_reduced = 0
        """Bytes this rank has handed to all-reduce so far (what a ring sends ~twice of)."""

    # the contract ----------------------------------------------------------------

    def reduce(
        self, bucket: torch.Tensor, *, shapes: list[torch.Size], bucket_index: int, step: int
    ) -> None:
        """Sum ``bucket`` (flat fp32, the tensors of ``shapes`` back to back) over the ranks."""
        if bucket.dim() != 1 or bucket.dtype != torch.float32:
            raise InvalidOptionError(
                f"bucket must be a flat float32 tensor, got {bucket.dtype} {bucket.shape}"
            )
        state = self._state(bucket, shapes, bucket_index)
        if step < self.config.start_step or not state.matrices:
            self._all_reduce(bucket, "all_reduce")
            return
        self._compressed(bucket, state, bucket_index)

    def step_skipped(self) -> None:
        """The step just reduced was skipped (inf or NaN): forget what it left behind."""
        for state in self._buckets.values():
            state.error, state.qs = None, []

    # state -----------------------------------------------------------------------

    def _state(self, bucket: torch.Tensor, shapes: list[torch.Size], index: int) -> _BucketState:
        shapes = [torch.Size(s) for s in shapes]
        known = self._buckets.get(index)
        if known is not None:
            if known.shapes != shapes:
                raise InvalidOptionError(
                    f"bucket {index} changed its layout ({len(known.shapes)} tensors before, "
                    f"{len(shapes)} now); PowerSGD keeps state per bucket"
                )
            return known
        total = sum(math.prod(s) for s in shapes)
        if total > bucket.numel():
            raise InvalidOptionError(
                f"shapes hold {total} elements, more than the bucket's {bucket.numel()}"
            )
        matrices, exact, offset = [], [], 0
        r = self.config.rank
        for shape in shapes:
            n = math.prod(shape)
            rows = shape[0] if len(shape) >= 2 else 0
            cols = n // rows if rows else 0
            rank = min(r, rows, cols)
            worth = rows and (rows + cols) * rank * self.config.min_compression_rate < n
            if worth:
                matrices.append(_Matrix(offset, rows, cols, rank))
            elif n:
                exact.append((offset, n))
            offset += n
        if offset < bucket.numel():
            exact.append((offset, bucket.numel() - offset))
        state = _BucketState(shapes, matrices, exact)
        self._buckets[index] = state
        return state

    def _initial_q(self, state: _BucketState, index: int) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(self.config.seed * 1_000_003 + index)
        return [torch.randn(m.rank, m.cols, generator=g) for m in state.matrices]

    def state_dict(self) -> dict[int, Any]:
        """Error feedback and warm-start matrices per bucket (this rank's)."""
        return {
            i: {"error": s.error, "qs": list(s.qs)}
            for i, s in self._buckets.items()
            if s.error is not None or s.qs
        }

    def load_state_dict(self, state: dict[int, Any]) -> None:
        """Restore :meth:`state_dict`; applied to each bucket at its next :meth:`reduce`."""
        self._pending = {int(i): dict(s) for i, s in state.items()}

    # the algorithm ---------------------------------------------------------------

    def _compressed(self, bucket: torch.Tensor, state: _BucketState, index: int) -> None:
        pending = self._pending.pop(index, None)
        if pending is not None:
            state.error, state.qs = pending["error"], list(pending["qs"])
        if self.config.error_feedback and state.error is None:
            state.error = torch.zeros_like(bucket)
        if not state.qs or not self.config.warm_start:
            state.qs = self._initial_q(state, index)
        if state.error is not None:
            bucket.add_(state.error)  # M = G + E, in place: the bucket is overwritten below
        ms = [
            bucket[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols)
            for m in state.matrices
        ]

        # First all-reduce: P of every matrix, and the exact slices.
        p_size = sum(m.rows * m.rank for m in state.matrices)
        exact_size = sum(n for _, n in state.exact)
        first = torch.empty(p_size + exact_size, dtype=bucket.dtype, device=bucket.device)
        ps, at = [], 0
        for m, mat, q in zip(state.matrices, ms, state.qs, strict=True):
            p = first[at : at + m.rows * m.rank].view(m.rows, m.rank)
            torch.mm(mat, q.t(), out=p)
            ps.append(p)
            at += m.rows * m.rank
        for off, n in state.exact:
            first[at : at + n].copy_(bucket[off : off + n])
            at += n
        self._all_reduce(first, "powersgd all_reduce of P")
        at = p_size
        for off, n in state.exact:
            bucket[off : off + n].copy_(first[at : at + n])
            at += n

        # Second all-reduce: Q = M^T orthonormal(P), kept transposed (r x m):
        # P^T M reads M row by row, several times faster than M^T P.
        q_size = sum(m.cols * m.rank for m in state.matrices)
        second = torch.empty(q_size, dtype=bucket.dtype, device=bucket.device)
        qs, at = [], 0
        for m, mat, p in zip(state.matrices, ms, ps, strict=True):
            orthonormalize_(p)
            q = second[at : at + m.cols * m.rank].view(m.rank, m.cols)
            torch.mm(p.t(), mat, out=q)
            qs.append(q)
            at += m.cols * m.rank
        self._all_reduce(second, "powersgd all_reduce of Q")

        # Result P Q^T (an approximation of the *sum* of the ranks' M), written
        # over M (no temporary the size of the bucket). Each rank keeps as error
        # its M minus a 1/world share of it, so the errors add up to exactly
        # what the result left out: sum(M) - P Q^T (the paper's error, summed).
        share = 1.0 / self._world_size()
        for m, mat, p, q in zip(state.matrices, ms, ps, qs, strict=True):
            if state.error is not None:
                err = state.error[m.offset : m.offset + m.rows * m.cols].view(m.rows, m.cols)
                err.copy_(mat)
                torch.mm(p, q, out=mat)
                err.add_(mat, alpha=-share)
            else:
                torch.mm(p, q, out=mat)
        state.qs = [q.clone() for q in qs]

    def _world_size(self) -> int:
        if self.collective is not None:
            return self.collective.world_size
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _all_reduce(self, tensor: torch.Tensor, operation: str) -> None:
        if self._world_size() == 1:
            return
        self.bytes_reduced += tensor.numel() * tensor.element_size()
        if self.collective is not None:  # its errors name the ranks already
            all_reduce(tensor, group=self.collective, timeout=self.config.timeout).wait()
            return
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=self.config.timeout))
        except Exception as exc:
            if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                raise CollectiveTimeoutError(
                    operation, [], self.config.timeout, detail=str(exc)
                ) from exc
            raise WorkerFailedError(f"{operation} failed: {exc}") from exc
