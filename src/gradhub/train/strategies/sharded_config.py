"""The settings of the ``sharded`` strategy (:mod:`.sharded`)."""

from __future__ import annotations

from dataclasses import dataclass

from gradhub import codecs
from gradhub.errors import InvalidOptionError


@dataclass(kw_only=True)
class ShardedConfig:
    """Settings of the ``sharded`` strategy."""

    compress: str = "none"
    """Wire codec for gradients and weights: ``"none"``, ``"fp16"``, ``"bf16"``,
    ``"bf16-truncate"``; arithmetic and master weights stay fp32."""
    bucket_mb: float = 25.0
    """Gradient bucket size in megabytes (fp32): fewer, larger messages vs. earlier overlap."""
    overlap: bool = True
    """Start each bucket's reduce-scatter from backward hooks as soon as it is full."""
    step_ahead: bool = True
    """With ``overlap``: step each bucket's part of the slice and all-gather its new
    weights during the backward, aside, and keep them at ``step()`` where that gives
    the same bits (:mod:`.sharded_ahead`; costs one more fp32 copy of the weights).
    False: both at ``step()``."""

    def __post_init__(self) -> None:
        codecs.check(self.compress, for_="sharded")  # an error now, not mid-job
        if not self.bucket_mb > 0:
            raise InvalidOptionError(f"bucket_mb must be > 0, got {self.bucket_mb}")
