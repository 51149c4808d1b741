"""gradhub as a ``torch.distributed`` backend: ``dist.init_process_group("gradhub")``.

``import gradhub`` (and, in processes that never import it, torch's
``torch.backends`` entry point, :mod:`gradhub_autoload`) registers the backend
``"gradhub"`` for CPU tensors. Its groups run all-reduce, reduce-scatter and
all-gather of fp32, bf16 and fp16 tensors, and broadcast, on gradhub's
transports (shared memory among the ranks of one host, hierarchical across
hosts holding several ranks, the ring otherwise) and everything else on a
gloo group of their own; DDP, FSDP2, DeviceMesh, Lightning, Accelerate and
Ray Train run on it unchanged. Bad arguments are refused on the calling rank,
from the call, and leave the group usable; only a dead or stalled peer
breaks it.

- :mod:`.registration`: registering, and building a group when torch asks.
- :mod:`.process_group`: :class:`GradhubProcessGroup`, one method per operation.
- :mod:`.checks`: what each operation refuses before anything is sent.
- :mod:`.operations`: what runs where; the summation order.
- :mod:`.work`: :class:`GradhubWork`, what every operation returns.
"""

from gradhub.backend.process_group import GradhubProcessGroup
from gradhub.backend.registration import NAME, register
from gradhub.backend.work import GradhubWork

__all__ = ["NAME", "GradhubProcessGroup", "GradhubWork", "register"]
