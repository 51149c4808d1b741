"""The shared-memory transport's additions (gradhub.transports.shm_sums) against
the stated numerics, bit for bit: 16-bit values widened, added in fp32 in
order, rounded once; every slice added on every rank in its owner's order.
The bf16 sums twice: by the C sum (gradhub._shm.native, which must build
on a machine with a C compiler) and by ATen, where the C sum is unavailable."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gradhub._shm import native
from gradhub.partition import partition_ranges
from gradhub.transports.schedule import reduction_order
from gradhub.transports.shm_sums import CHUNK, add_everywhere, add_widened

SPECIAL = {
    torch.bfloat16: [3.3e38, -3.3e38, 2.0**-133, 1.0, 2.0**-8, -0.0, 0.0, float("inf")],
    torch.float16: [65504.0, -65504.0, 2.0**-24, 1.0, 2.0**-11, -0.0, 0.0, float("-inf")],
}


@pytest.fixture(params=["C sum", "ATen"])
def how(request: pytest.FixtureRequest) -> Iterator[str]:
    """Which adds bf16 values: the C sum or, with it made unavailable, ATen."""
    if request.param == "C sum" and not native.available():
        pytest.skip("no C sum on this machine (no compiler?)")
    native.available()  # the build or load has ended: nothing sets it meanwhile
    saved = native._library
    if request.param == "ATen":
        native._library = None  # as before the build has ended, or where it failed
    yield request.param
    native._library = saved


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_c_sum_builds_where_there_is_a_compiler() -> None:
    assert native.available()


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_c_sum_is_kept_in_the_temporary_folder_where_the_cache_is_unwritable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # its gradhub/ cannot be made
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert native._build() is not None
    assert list((tmp_path / "tmp").glob("gradhub-*/native-*.so"))
    monkeypatch.setenv("GRADHUB_NATIVE", "0")
    assert native._build() is None


def test_the_c_sum_rounds_as_aten_for_every_bf16_value() -> None:
    """Every bf16 bit pattern plus a shuffle of them, and plus its own
    neighbour: ATen's bits (NaN: a NaN)."""
    if not native.available():
        pytest.skip("no C sum on this machine (no compiler?)")
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    for other in (every[torch.randperm(every.numel(), generator=g)], every.roll(1)):
        out = torch.empty_like(every)
        assert native.sum_bf16([every, other], out)
        want = torch.add(every, other)
        nan = want.isnan()
        assert torch.equal(out.isnan(), nan)
        assert torch.equal(out[~nan].view(torch.int16), want[~nan].view(torch.int16))


def reference(parts: list[torch.Tensor], own: torch.Tensor) -> torch.Tensor:
    acc = parts[0].to(torch.float32)
    for p in [*parts[1:], own]:
        acc = acc + p.to(torch.float32)
    return acc.to(own.dtype)


def vectors(count: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """``count`` vectors whose sums round visibly: values of every magnitude,
    ties, overflow, subnormals, signed zeros."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g))
        k = min(n, len(SPECIAL[dtype]))
        x[:k] = torch.tensor(SPECIAL[dtype][:k]) * (1 if i % 2 == 0 else 0.5)
        out.append(x.to(dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 1000, CHUNK + 7])
def test_sum_is_the_fp32_sum_in_order_rounded_once(
    dtype: torch.dtype, ranks: int, n: int, how: str
) -> None:
    *parts, own = vectors(ranks, n, dtype, seed=ranks * 7 + n)
    want = reference(parts, own)
    out = torch.empty(n, dtype=dtype)
    add_widened(parts, own, out, torch.empty(min(n, CHUNK)))
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    # in place (out is own), as the shared-memory transport sums
    add_widened(parts, own, own, torch.empty(min(n, CHUNK)))
    assert torch.equal(own.view(torch.int16), want.view(torch.int16))


def test_rounding_once_differs_from_rounding_per_addition(how: str) -> None:
    """The case the fp32 accumulation exists for: in bf16 (unit roundoff
    2**-8) 1 + 2**-8 + 2**-8 rounds to 1 after each addition (ties to even),
    to 1 + 2**-7 when rounded once at the end."""
    one, tiny = torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2.0**-8]).bfloat16()
    out = torch.empty(1, dtype=torch.bfloat16)
    add_widened([one, tiny], tiny, out, torch.empty(1))
    assert out.item() == 1.0 + 2.0**-7
    assert (one + tiny + tiny).item() == 1.0


class _Group:
    """The one thing the additions ask of a CollectiveGroup: scratch buffers."""

    def scratch(self, slot: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_every_slice_is_added_in_its_owners_order(dtype: torch.dtype, ranks: int, how: str) -> None:
    """What the reduce-scatter forms on the owner of each slice, formed for the
    whole vector on any rank (the one-synchronisation all-reduce)."""
    n = 1001
    if dtype == torch.float32:
        g = torch.Generator().manual_seed(ranks)
        regions = [torch.randn(n, generator=g) * 10.0 ** (r - 2) for r in range(ranks)]
    else:
        regions = vectors(ranks, n, dtype, seed=ranks)
    want = torch.empty(n, dtype=dtype)
    for c, (s, m) in enumerate(partition_ranges(n, ranks)):
        *parts, own = [regions[j][s : s + m] for j in reduction_order(c, ranks)]
        if dtype == torch.float32:  # the ring's fp32 additions, one rounding each
            acc = parts[0].clone()
            for p in [*parts[1:], own]:
                acc = acc + p
            want[s : s + m] = acc
        else:
            want[s : s + m] = reference(parts, own)
    out = torch.empty(n, dtype=dtype)
    add_everywhere(regions, out, _Group())  # type: ignore[arg-type]
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
