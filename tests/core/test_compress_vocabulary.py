"""One ``compress=`` vocabulary (gradhub.codecs.check): every entry point refuses an
unknown name with the same message, naming itself and listing what it takes."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest

from gradhub import RemoteParameterServer, codecs
from gradhub.ps import ClientConfig
from gradhub.train import reducers
from gradhub.train.reducers import registry
from gradhub.train.strategies import make_strategy
from gradhub.train.strategies.allreduce import AllReduceConfig
from gradhub.train.strategies.diloco import DiLoCoConfig
from gradhub.train.strategies.sharded import ShardedConfig

WIRE = "none, fp16, bf16, bf16-truncate (wire codecs)"
TENSOR = "none, fp16, bf16, bf16-truncate, fp4 (tensor codecs)"
BUCKET = "bf16, fp16, none, powersgd (bucket reducers; gradhub.train.reducers.register adds one)"
ADDRESS = "tcp://127.0.0.1:1"  # never connected: the name is refused first

ENTRY_POINTS: list[tuple[str, str, Callable[[str], Any]]] = [
    ("allreduce", BUCKET, lambda c: AllReduceConfig(compress=c)),
    ("allreduce", BUCKET, lambda c: make_strategy("allreduce", compress=c)),
    ("allreduce", BUCKET, lambda c: reducers.make(c)),
    ("sharded", WIRE, lambda c: ShardedConfig(compress=c)),
    ("sharded", WIRE, lambda c: make_strategy("sharded", compress=c)),
    ("ps-async/ps-sync/ps-ssp", WIRE, lambda c: make_strategy("ps-sync", compress=c)),
    (
        "RemoteParameterServer",
        WIRE,
        lambda c: ClientConfig(addresses=ADDRESS, worker_id=0, compress=c),
    ),
    (
        "RemoteParameterServer",
        WIRE,
        lambda c: RemoteParameterServer(ADDRESS, worker_id=0, compress=c),
    ),
    ("a wire codec", WIRE, lambda c: codecs.get(c)),
    ("diloco", TENSOR, lambda c: DiLoCoConfig(compress=c)),
    ("diloco", TENSOR, lambda c: make_strategy("diloco", compress=c)),
]


@pytest.mark.parametrize(
    ("entry", "listing", "build"),
    ENTRY_POINTS,
    ids=[f"{e}-{i}" for i, (e, _, _) in enumerate(ENTRY_POINTS)],
)
@pytest.mark.parametrize("name", ["zip", "powersgd", "bf16-truncate"])
def test_each_entry_point_refuses_an_unknown_name_with_one_message(
    entry: str, listing: str, build: Callable[[str], Any], name: str
) -> None:
    if name in listing.split(" (")[0].split(", "):
        return  # a name this entry point takes
    expected = f"unknown compress={name!r} for {entry}\n- help: choose one of {listing}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        build(name)


def test_the_entry_points_take_their_names() -> None:
    for name in codecs.available(codecs.WIRE):
        assert ShardedConfig(compress=name).compress == name
        assert ClientConfig(addresses=ADDRESS, worker_id=0, compress=name.upper()).compress == name
    for name in reducers.available():
        assert AllReduceConfig(compress=name).compress == name
    for name in codecs.available(codecs.TENSOR):
        assert DiLoCoConfig(compress=name.upper()).compress == name


def test_a_registered_reducer_joins_the_vocabulary_of_allreduce_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry, "_REDUCERS", dict(registry._REDUCERS))  # this test's registry
    reducers.register("topk", lambda **kw: reducers.AllReduce(**kw))
    assert AllReduceConfig(compress="topk").compress == "topk"
    assert "topk" in reducers.available()
    with pytest.raises(ValueError, match="already registered"):
        reducers.register("topk", lambda **kw: reducers.AllReduce(**kw))
    with pytest.raises(ValueError, match=re.escape(f"for sharded\n- help: choose one of {WIRE}")):
        ShardedConfig(compress="topk")
