"""Streaming DiLoCo's fragments: which parameters each holds, when each syncs.

The rule: the trainable parameters, in registration order (``model.parameters()``),
are cut into ``F`` contiguous groups; fragment ``f`` ends at the first parameter
boundary at or past ``(f + 1) / F`` of all their elements, taking at least one
parameter and leaving at least one for each later fragment (so about equal in
elements where the parameters allow; a parameter is never split). Fragment
``f`` syncs at every inner step ``n`` (1, 2, ... since the start) with
``n % H == f * H // F`` (its offset): each fragment once per ``H`` steps,
fragment 0 at ``H, 2H, ...``, the others staggered between; the first sync of
fragment ``f > 0`` covers its first ``f * H // F`` steps.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def cut(sizes: Sequence[int], fragments: int) -> list[range]:
    """The parameter indices of each fragment (see the module docstring);
    ``1 <= fragments <= len(sizes)``."""
    count = len(sizes)
    assert 1 <= fragments <= count, (fragments, count)
    total = sum(sizes)
    bounds = [0]
    done = 0  # elements in the fragments cut so far
    for f in range(1, fragments):
        i = bounds[-1]
        done += sizes[i]
        i += 1  # at least one parameter
        while i < count - (fragments - f) and done * fragments < f * total:
            done += sizes[i]
            i += 1
        bounds.append(i)
    bounds.append(count)
    return [range(a, b) for a, b in itertools.pairwise(bounds)]


def offsets(inner_steps: int, fragments: int) -> list[int]:
    """The step offset of each fragment in a period of ``inner_steps``."""
    return [f * inner_steps // fragments for f in range(fragments)]


__all__ = ["cut", "offsets"]
