"""AllReduceParameter: a flat parameter whose slices are owned by the ranks.

BigDL's ``AllReduceParameter`` on ``torch.distributed``. Rank ``p`` of ``P``
owns slice ``p`` of the flat parameter (:func:`gradhub.partition.partition_range`):

.. code-block:: python

    p = AllReduceParameter(size, compress="bf16")
    pid, start, length = p.init(weights)          # fp32 master copy of own slice
    for batch in data:
        p.get_weights(weights).wait()             # all-gather the published slices
        grads = compute_gradients(weights, batch)
        p.put_gradients(grads)                    # slice, compress, reduce-scatter
        g = p.aggregate_gradient_partition(n)     # fp32 sum of own slice / n
        update(p.weight_partition, g)             # e.g. ShardedOptimizer
        p.send_weight_partition()                 # publish the updated slice

Decisions (where BigDL's block-manager design does not carry over):

- ``init`` is a collective: every rank's ``size`` and codec are gathered, and a difference is an
  error on every rank (not a hang on some).
- ``send_weight_partition`` publishes a snapshot (encoded in the codec) of ``weight_partition``;
  ``get_weights`` gathers the published snapshots, so later in-place changes to
  ``weight_partition`` are not seen until the next ``send_weight_partition``. ``init`` publishes
  the initial slice.
- Every rank, the owner included, receives the decoded wire values, so all ranks hold
  bit-identical weights; the owner's fp32 master is unchanged.
- ``put_gradients`` copies the gradient into the flat gradient buffer (the caller may reuse it at
  once) and starts the reduce-scatter on the group's worker thread;
  ``aggregate_gradient_partition`` waits for it. A second ``put_gradients`` before
  ``aggregate_gradient_partition`` is an error.
- ``gradient_partition``: this rank's slice of that buffer, summed in place (the same bits as out
  of place) and divided by ``avg_numbers`` (as BigDL; not by 1: the same bits); meaningful from
  ``aggregate_gradient_partition`` until the next gradient is written. Buffers are reused from
  step to step.
- ``device``: where the buffers live (default: the group's device). CUDA buffers of a group that
  carries host memory only are staged (:mod:`.staging`); CPU ones go where the group's transport
  reads them in place (``"shm"``), so the bound cycle's collectives read them where they lie.
- Zero copies (DDP's ``gradient_as_bucket_view``, FSDP's flat parameters; :mod:`.flat_views`):
  :meth:`bind` makes parameters views of :attr:`flat_weights` and their grads views of
  :attr:`flat_gradients`; given those, ``put_gradients`` and ``get_weights`` copy nothing. Without
  compression ``weight_partition`` is this rank's slice of :attr:`flat_weights`; once that is
  handed out, ``send_weight_partition`` publishes ``weight_partition`` itself (no snapshot: the
  next ``get_weights`` sends what it holds then). Other tensors are still copied.
- Parameters may be a tensor of ``size`` elements or a tree (flattened via
  :class:`gradhub.trees.TreeSpec`; the tree given to ``init`` fixes the structure).
  ``get_weights`` accepts either a flat tensor of ``size`` or a tree of that structure.
"""

from __future__ import annotations

import logging
import zlib

import torch

from gradhub import codecs
from gradhub.collective import staging
from gradhub.collective.agreement import check_agreement
from gradhub.collective.collectives import (
    DEFAULT_PIPELINE_ELEMENTS,
    Group,
    run_all_gather,
    run_reduce_scatter,
    run_shared_vectors,
)
from gradhub.collective.flat_views import bind_views, occupies
from gradhub.errors import ClosedError, InvalidOptionError, StateError, WrongTypeError
from gradhub.partition import partition_range, segment_ranges
from gradhub.transports.group import CollectiveFuture, CollectiveGroup
from gradhub.trees import Tree, TreeSpec, as_tree

_log = logging.getLogger("gradhub.collective")


class AllReduceParameter:
    """A flat parameter of ``size`` elements sliced over the ranks of ``group``.

    ``group``: a :class:`CollectiveGroup`, a torch process group, or ``None``
    for the default one (wrapped for this object alone, with that group's
    own timeout; share a :class:`CollectiveGroup`, e.g. ``gradhub.init().group``,
    between objects used concurrently on one process group). ``compress``: a
    codec name (:func:`gradhub.codecs.get`) for the wire; arithmetic and
    master weights stay fp32. ``timeout``: seconds per operation (default:
    the group's). ``device``: see the module docstring. Every rank must create
    it with the same arguments and call its methods in the same order.
    """

    def __init__(
        self,
        size: int,
        *,
        group: Group = None,
        compress: str | codecs.Codec = "none",
        timeout: float | None = None,
        pipeline_elements: int = DEFAULT_PIPELINE_ELEMENTS,
        device: torch.device | str | None = None,
    ):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise InvalidOptionError(f"size must be an int >= 0, got {size!r}")
        if timeout is not None and not timeout > 0:
            raise InvalidOptionError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.group = CollectiveGroup.of(group)
        self._owns_group = self.group is not group  # a wrapper made here is closed with self
        self.codec = codecs.get(compress, for_="AllReduceParameter")
        self.gradient_codec = self.codec
        """The codec of the gradients' wire; ``codec`` by default (the ``sharded``
        strategy sets a non-saturating fp16 under loss scaling)."""
        self.size = size
        self.timeout = self.group.timeout if timeout is None else float(timeout)
        self.partition_id = self.group.rank
        self.partition_num = self.group.world_size
        self._start, self._length = partition_range(size, self.partition_num, self.partition_id)
        self._pipeline = pipeline_elements
        self.device = device = self.group.device if device is None else torch.device(device)
        own = slice(self._start, self._start + self._length)
        # zeros: calloc'd, so the other ranks' slices take no memory until touched
        self._flat_weights = torch.zeros(size, dtype=torch.float32, device=device)
        self._flat_gradients = torch.zeros(size, dtype=torch.float32, device=device)
        self._plain = isinstance(self.codec, codecs.NoCompression)
        # the master: its own slice of the weights when the wire holds fp32 itself
        self._weights = (
            self._flat_weights[own]
            if self._plain
            else torch.zeros(self._length, dtype=torch.float32, device=device)
        )
        self._gradients = self._flat_gradients[own]
        self._views_out = False  # flat_weights handed out: publish weight_partition itself
        self._handed_out = False  # a buffer or slice handed out before init: keep these
        self._published: torch.Tensor | None = None
        self._gathering: list[CollectiveFuture[Tree]] = []  # get_weights reading _published
        self._pending: list[CollectiveFuture[torch.Tensor]] = []
        self._covered = 0  # elements of this step's gradient put so far (segments)
        self._spec: TreeSpec | None = None
        self._closed = False

    # ------------------------------------------------------------ properties
    @property
    def local_partition_range(self) -> tuple[int, int]:
        """``(start, length)`` of this rank's slice."""
        return self._start, self._length

    @property
    def weight_partition(self) -> torch.Tensor:
        """The fp32 master copy of this rank's slice; update it in place."""
        self._handed_out = True
        return self._weights

    @property
    def gradient_partition(self) -> torch.Tensor:
        """The last aggregated fp32 gradient of this rank's slice (divided by ``avg_numbers``)."""
        self._handed_out = True
        return self._gradients

    @property
    def initialized(self) -> bool:
        return self._spec is not None

    @property
    def flat_weights(self) -> torch.Tensor:
        """The flat fp32 weights (``size`` elements) that :meth:`get_weights` fills in
        place when given them, or views of them (:meth:`bind`). Handing them out
        makes ``send_weight_partition`` publish ``weight_partition`` itself."""
        self._views_out = self._handed_out = True
        if self._plain:
            self._published = self._weights  # from now on the master itself is published
        return self._flat_weights

    @property
    def flat_gradients(self) -> torch.Tensor:
        """The flat fp32 gradient buffer (``size`` elements) that :meth:`put_gradients`
        reduces in place when given it, or views of it (:meth:`bind`)."""
        self._handed_out = True
        return self._flat_gradients

    # ---------------------------------------------------------------- methods
    def init(self, parameter: Tree) -> tuple[int, int, int]:
        """Keep an fp32 copy of this rank's slice of ``parameter`` and publish it.

        A collective: checks that every rank has the same ``size`` and codec
        and a parameter of ``size`` elements, else raises on every rank.
        Returns ``(partition_id, start, length)``.
        """
        self._check_open("init")
        if self._spec is not None:
            raise StateError(f"[rank {self.partition_id}] AllReduceParameter.init called twice")
        spec = TreeSpec.of(parameter)
        codec_id = zlib.crc32(self.codec.name.encode())
        own = self._handed_out or self.device.type != "cpu"  # keeps its own buffers
        rows = self.group.submit(
            "AllReduceParameter.init",
            lambda: self.group.all_gather_ints(
                [self.size, spec.numel, codec_id, own], "AllReduceParameter.init"
            ),
        ).wait()
        check_agreement(rows, self.size, self.codec.name, self.partition_id)
        if not any(row[3] for row in rows):
            self._share_buffers()
        flat = spec.flatten(parameter).to(self.device)
        self._weights.copy_(flat[self._start : self._start + self._length])
        self._spec = spec
        self.send_weight_partition()
        _log.debug("[rank %d] %r owns %s", self.partition_id, self, self.local_partition_range)
        return self.partition_id, self._start, self._length

    def _share_buffers(self) -> None:
        """The flat buffers (zeros, none handed out) where the transport reads them in place."""
        shared = self.group.submit(
            "AllReduceParameter.init",
            lambda: run_shared_vectors(self.group, 2, self.size, name="AllReduceParameter.init"),
        ).wait()
        if shared is not None:
            self._flat_weights, self._flat_gradients = shared  # a new segment holds zeros
            own = slice(self._start, self._start + self._length)
            self._weights = self._flat_weights[own] if self._plain else self._weights
            self._gradients = self._flat_gradients[own]

    def bind(self, parameters: Tree) -> None:
        """Make every tensor of ``parameters`` a view of :attr:`flat_weights` and its
        ``.grad`` a view of :attr:`flat_gradients`, at its place in the flat vector.

        ``parameters``: a tree like ``init``'s (e.g. ``list(model.parameters())``),
        fp32 on :attr:`device`; they keep their values (:func:`.bind_views`)
        except this rank's slice, which holds ``weight_partition``. Then pass
        them (or :attr:`flat_weights`) to ``get_weights`` and their grads (or
        :attr:`flat_gradients`) to ``put_gradients``: nothing is copied.
        """
        self._check_ready("bind")
        assert self._spec is not None
        tensors = self._spec.leaves(parameters)
        flat_weights = self.flat_weights
        master = self._weights.clone()  # this rank's slice keeps the master
        bind_views(tensors, flat_weights, self._flat_gradients, f"[rank {self.partition_id}]")
        self._weights.copy_(master)
        if not self._plain:  # every rank holds the decoded wire values
            own = flat_weights[self._start : self._start + self._length]
            own.copy_(self.codec.decode(self.codec.encode(master)))

    def get_weights(self, local_parameter: Tree) -> CollectiveFuture[Tree]:
        """All-gather every rank's published slice into ``local_parameter``.

        ``local_parameter``: a tensor of ``size`` elements or a tree like the one
        given to ``init``; it is filled in place by the time ``wait()`` returns
        it. Do not read or write it before then.
        """
        self._check_ready("get_weights")
        assert self._spec is not None and self._published is not None
        target = as_tree(local_parameter)
        flat_target = isinstance(target, torch.Tensor) and target.numel() == self.size
        if not flat_target:
            self._spec.check(target)
        in_place = self._views_out and occupies(self._spec, target, self._flat_weights)
        direct = in_place or (
            isinstance(target, torch.Tensor)
            and flat_target
            and target.dtype == torch.float32
            and target.is_contiguous()
            and target.device == self.device
        )
        wire, spec, stage = self._published, self._spec, staging.begin(self.group, self._published)

        def body() -> Tree:
            out = self._flat_weights if in_place else target.view(-1) if direct else None
            gathered = run_all_gather(
                self.group,
                wire,
                self.size,
                self.codec,
                out=out,
                timeout=self.timeout,
                pipeline=self._pipeline,
                name="get_weights(all_gather)",
                stage=stage,
            )
            if not direct:
                with torch.no_grad():
                    if flat_target:
                        target.view(-1).copy_(gathered)
                    else:
                        spec.unflatten_into(gathered, target)
            return local_parameter

        future = self.group.submit("get_weights", body)
        self._gathering = [f for f in self._gathering if not f.done()] + [future]
        return future

    def holds_all_weights(self, local_parameter: Tree) -> bool:
        """Whether :meth:`get_weights` into ``local_parameter`` would move nothing (one
        rank publishing in place, into its flat weights): a caller may skip its Python."""
        spec, one = self._spec, self.partition_num == 1 and self._views_out and self._plain
        return one and spec is not None and occupies(spec, local_parameter, self._flat_weights)

    def put_gradients(self, gradient: Tree) -> None:
        """Copy ``gradient`` (``size`` elements or a tree like the parameter) and
        start reducing it: each rank ends up with the sum of its own slice."""
        self._check_ready("put_gradients")
        assert self._spec is not None
        if self._pending:
            raise StateError(
                f"[rank {self.partition_id}] put_gradients called twice; call "
                "aggregate_gradient_partition() after each put_gradients()"
            )
        tree = as_tree(gradient)
        # One flat vector, reused: the previous reduce-scatter that read it has
        # finished (aggregate_gradient_partition waited for it). Views of it
        # (bind) are already in place.
        flat = self._flat_gradients
        if occupies(self._spec, tree, flat):
            pass
        elif isinstance(tree, torch.Tensor) and tree.numel() == self.size:
            flat.copy_(tree.detach().reshape(-1))
        else:
            self._spec.flatten(tree, out=flat)  # validates before it writes
        self._covered = self.size
        codec, stage = self.gradient_codec, staging.begin(self.group, flat)
        self._pending = [
            self.group.submit(
                "put_gradients",
                lambda: run_reduce_scatter(
                    self.group,
                    flat,
                    codec,
                    out=self._gradients,
                    timeout=self.timeout,
                    pipeline=self._pipeline,
                    name="put_gradients(reduce_scatter)",
                    stage=stage,
                ),
            )
        ]

    def put_gradient_segment(self, segment: torch.Tensor, offset: int) -> None:
        """Start reducing elements ``[offset, offset + segment.numel())`` of the flat
        gradient: each rank ends with the sum of the part of it that lies in its own slice.

        For overlapping communication with backward: a step's gradient may go
        in segments as they become ready, instead of one ``put_gradients``.
        ``segment`` is a flat contiguous fp32 tensor, read in place (no copy:
        leave it unchanged until ``aggregate_gradient_partition`` returns).
        Every rank gives the same segments in the same order; together they
        cover the vector once (checked by ``aggregate_gradient_partition``).
        Without compression the sums are the bits ``put_gradients`` gives.
        """
        self._check_ready("put_gradient_segment")
        n = segment.numel()
        if offset < 0 or offset + n > self.size or self._covered + n > self.size:
            raise InvalidOptionError(
                f"[rank {self.partition_id}] segment [{offset}, {offset + n}) does not fit "
                f"the {self.size - self._covered} elements of {self.size} not yet put"
            )
        if segment.dtype != torch.float32 or not segment.is_contiguous():
            raise WrongTypeError("put_gradient_segment takes a contiguous float32 tensor")
        ranges = segment_ranges(self.size, self.partition_num, offset, n)
        here, length = ranges[self.partition_id]
        begin = offset + here - self._start
        out = self._gradients[begin : begin + length] if length else self._gradients[:0]
        flat = segment.view(-1)
        self._covered += n
        codec, stage = self.gradient_codec, staging.begin(self.group, flat)
        self._pending.append(
            self.group.submit(
                "put_gradient_segment",
                lambda: run_reduce_scatter(
                    self.group,
                    flat,
                    codec,
                    out=out,
                    timeout=self.timeout,
                    pipeline=self._pipeline,
                    name="put_gradient_segment(reduce_scatter)",
                    ranges=ranges,
                    stage=stage,
                ),
            )
        )

    def aggregate_gradient_partition(self, avg_numbers: float = 1) -> torch.Tensor:
        """Wait for the reduce-scatter; return the fp32 sum of this rank's slice
        over all ranks divided by ``avg_numbers`` (also kept as ``gradient_partition``)."""
        self._check_ready("aggregate_gradient_partition")
        if not avg_numbers > 0:
            raise InvalidOptionError(f"avg_numbers must be > 0, got {avg_numbers!r}")
        if not self._pending:
            raise StateError(
                f"[rank {self.partition_id}] nothing to aggregate: call put_gradients() first"
            )
        pending, self._pending = self._pending, []
        covered, self._covered = self._covered, 0
        for future in pending:
            future.wait()  # the sum is now in self._gradients
        if covered != self.size:
            raise StateError(
                f"[rank {self.partition_id}] the gradient segments put cover {covered} of "
                f"{self.size} elements"
            )
        if avg_numbers != 1:  # x / 1 == x: skip a pass over the slice
            self._gradients.div_(avg_numbers)
        return self._gradients

    def send_weight_partition(self) -> None:
        """Publish the current ``weight_partition`` (encoded) for ``get_weights``."""
        self._check_open("send_weight_partition")
        if self._views_out and self._plain:
            self._published = self._weights  # published in place: nothing to copy
            return
        published = self._published
        if (
            isinstance(self.codec, codecs.NoCompression)
            and published is not None
            and not any(not f.done() for f in self._gathering)
        ):
            # No all-gather reads the previous snapshot any more: overwrite it
            # (a fresh vector per step would be page-faulted in every time).
            published.copy_(self._weights)
        else:
            self._published = self.codec.encode(self._weights)

    # -------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Refuse further use. The process group stays up (it is not this object's);
        a wrapper made of a plain torch process group (or the default one) is closed.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._pending = []
        if self._owns_group:
            self.group.close()

    def __enter__(self) -> AllReduceParameter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClosedError(f"[rank {self.partition_id}] {what}: AllReduceParameter is closed")

    def _check_ready(self, what: str) -> None:
        self._check_open(what)
        if self._spec is None:
            raise StateError(f"[rank {self.partition_id}] {what}: call init(parameter) first")

    def __repr__(self) -> str:
        return (
            f"AllReduceParameter(size={self.size}, partition_id={self.partition_id}, "
            f"partition_num={self.partition_num}, compress={self.codec.name!r})"
        )
