"""What ``AllReduceParameter.init`` checks across the ranks: one size, one codec.

``init`` gathers ``[size, elements of the parameter, codec id, ...]`` from
every rank; a difference is an error on every rank (the same rows reach
every rank, so all raise), not a hang on some.
"""

from __future__ import annotations

from gradhub.errors import InvalidOptionError, ShapeMismatchError


def check_agreement(rows: list[list[int]], size: int, codec: str, rank: int) -> None:
    """Raise if the ranks' rows (by rank) disagree on the size or the codec, or
    if a rank's parameter does not hold ``size`` elements."""
    sizes = {r: row[0] for r, row in enumerate(rows)}
    if len(set(sizes.values())) > 1:
        raise ShapeMismatchError(
            "AllReduceParameter",
            "the same size on every rank",
            f"sizes by rank {sizes}; create it with the same size everywhere",
            "size",
        )
    if len({row[2] for row in rows}) > 1:
        raise InvalidOptionError(
            f"[rank {rank}] AllReduceParameter codecs differ between ranks "
            f"(this rank: {codec!r}); pass the same compress= on every rank"
        )
    wrong = {r: row[1] for r, row in enumerate(rows) if row[1] != size}
    if wrong:
        raise ShapeMismatchError(
            "AllReduceParameter.init",
            f"a parameter of {size} elements",
            f"elements by rank {wrong}",
            "size",
        )
