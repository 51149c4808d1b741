"""The small-message path (``gradhub.ps.wire.protocol.small`` and its callers) against
the general one: the same bytes on the wire, the same checks, the same server
state and replies, and exactly-once kept for a retried small push. On the client,
a push's bytes come from one numpy view (``small.wire_of``); on the server, a
small gradient is written into a tensor the store keeps per key
(``ParameterStore.small_grad``): both give the general path's bytes and bits."""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Iterator

import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from gradhub import RemoteParameterServer, ServerConfig, start_server
from gradhub.errors import ProtocolError
from gradhub.optim import OptimizerSpec
from gradhub.ps.client import remote as remote_module
from gradhub.ps.server.dedupe import Ledger
from gradhub.ps.server.store import ParameterStore
from gradhub.ps.wire import protocol
from gradhub.ps.wire.protocol import FLAG_REPLY, Header, Op, Status, small
from gradhub.ps.wire.protocol.message import DTYPES

_SECRETS = st.sampled_from([None, b"k" * 32])
_KEYS = st.text(min_size=0, max_size=12)
_U64 = st.integers(0, 2**63 - 1)


def _request(op: Op, key: str, payload: torch.Tensor | None, meta: bytes, secret: bytes | None):
    """(small.pack_request's frame, encode's frames) of the same request."""
    fields = dict(request_id=7, worker_id=3, session=11, seq=5, incarnation=13, aux=1200)
    lean = small.pack_request(
        op, key, payload, meta, -2, 3, 7, 11, 5, 13, 1200, secret
    )  # priority -2
    header = Header(op=op, priority=-2, **fields)
    frames = protocol.encode(header, key, payload, meta=meta, secret=secret, pack=True)
    return lean, frames


@settings(max_examples=60, deadline=None)
@given(
    secret=_SECRETS,
    key=_KEYS,
    dtype=st.sampled_from(sorted(DTYPES.values(), key=str)),
    shape=st.lists(st.integers(0, 3), max_size=3),
    meta=st.sampled_from([b"", b'{"skip": true}']),
    op=st.sampled_from([Op.PUSH, Op.INIT, Op.PULL]),
)
def test_packed_request_bytes_and_reading_match_the_general_path(
    secret: bytes | None, key: str, dtype: torch.dtype, shape: list[int], meta: bytes, op: Op
) -> None:
    numel = int(torch.tensor(shape, dtype=torch.int64).prod())
    payload = (torch.arange(numel) % 2).to(dtype).reshape(shape)
    lean, frames = _request(op, key, payload, meta, secret)
    assert frames == [lean]  # one packed frame, bit for bit
    got = small.read_request(lean, secret, 1 << 20)
    want = protocol.decode(frames, secret=secret, max_payload=1 << 20)
    assert got is not None
    assert got.header == want.header and got.key == want.key and got.meta == want.meta
    assert bytes(got.payload) == bytes(want.payload)
    assert torch.equal(got.tensor(), want.tensor())
    known = small.wire_of(payload)
    assert (known is None) == (numel == 0 or dtype == torch.bfloat16)  # numpy has no bfloat16
    if known is not None:  # the client's small push: the same frame from its wire form
        wired = small.pack_request(
            op, key, payload, meta, -2, 3, 7, 11, 5, 13, 1200, secret, known[0]
        )
        assert wired == lean


def test_wire_form_leaves_to_the_general_path_what_needs_it() -> None:
    base = torch.arange(6, dtype=torch.float32)
    assert small.wire_of(base) is not None
    for t in (
        base.clone().requires_grad_(),
        base._neg_view(),
        base[::2],  # not contiguous
        torch.nn.Parameter(base.clone(), requires_grad=False),  # a subclass
        torch.empty(0),
        base.to(torch.bfloat16),
    ):
        assert small.wire_of(t) is None, t


@settings(max_examples=60, deadline=None)
@given(secret=_SECRETS, key=_KEYS, aux=_U64, incarnation=_U64, rid=_U64)
def test_acknowledgement_bytes_and_reading_match_the_general_path(
    secret: bytes | None, key: str, aux: int, incarnation: int, rid: int
) -> None:
    request = Header(op=Op.PUSH, request_id=rid, worker_id=1, session=2, seq=3, priority=4)
    header = protocol.reply(request, incarnation=incarnation, aux=aux)
    frames = protocol.encode(header, key, None, secret=secret, pack=True)
    lean = small.pack(
        Op.PUSH, FLAG_REPLY, Status.OK, key.encode(), 1, 4, rid, 2, 3, incarnation, aux, secret
    )
    assert frames == [lean]
    assert small.read_ack(lean, secret) == (Op.PUSH, Status.OK, rid, incarnation, aux)
    msg = protocol.decode(frames, secret=secret)
    assert (msg.header.request_id, msg.header.incarnation, msg.header.aux) == (
        rid,
        incarnation,
        aux,
    )


def test_what_the_small_readers_leave_to_decode() -> None:
    secret = b"s" * 32
    lean, _ = _request(Op.PUSH, "k", torch.ones(2), b"", secret)
    assert small.read_request(lean, secret, 1 << 20) is not None
    assert small.read_request(lean, None, 1 << 20) is None  # signed, no secret here
    assert small.read_request(lean, b"t" * 32, 1 << 20) is None  # another secret
    assert small.read_request(lean, secret, 4) is None  # over the payload limit
    assert small.read_request(lean[:-1], secret, 1 << 20) is None
    for bad in (lean[:-1], lean[:10]):
        with pytest.raises(ProtocolError):
            protocol.decode([bad], secret=secret)
    # An ack is not a request, a request is not an ack, a reply with a payload is not an ack.
    ack = small.pack(Op.PUSH, FLAG_REPLY, Status.OK, b"k", 0, 0, 1, 2, 3, 4, 5, secret)
    assert small.read_request(ack, secret, 1 << 20) is None
    assert small.read_ack(lean, secret) is None
    header = protocol.reply(Header(op=Op.PULL), incarnation=1)
    pulled = protocol.encode(header, "k", torch.ones(1), secret=secret, pack=True)[0]
    assert small.read_ack(pulled, secret) is None
    assert small.read_ack(ack, None) is None
    tampered = bytearray(ack)
    tampered[40] ^= 1
    assert small.read_ack(bytes(tampered), secret) is None
    with pytest.raises(ProtocolError):
        protocol.decode([bytes(tampered)], secret=secret)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 30), unique=True, min_size=1))
def test_ledger_marks_in_any_order_as_a_set_would(order: list[int]) -> None:
    ledger, marked = Ledger(), set()
    for seq in order:
        ledger.mark(1, 9, seq)
        marked.add(seq)
        low = 0
        while low + 1 in marked:
            low += 1
        assert ledger.low(1, 9) == low
        assert all(ledger.applied(1, 9, s) == (s in marked) for s in range(1, 32))


def _run(monkeypatch: pytest.MonkeyPatch | None, secret: str | None) -> tuple[list[int], dict]:
    """Pushes, inits and pulls through a server in this process; with ``monkeypatch``
    every small reader and packer says ``None``: the general path throughout."""
    if monkeypatch is not None:
        monkeypatch.setattr(small, "read_request", lambda *a: None)
        monkeypatch.setattr(small, "read_ack", lambda *a: None)
        monkeypatch.setattr(small, "pack_request", lambda *a: None)
        monkeypatch.setattr(remote_module, "wire_of", lambda t: None)
        monkeypatch.setattr(ParameterStore, "small_grad", lambda *a: None)
    config = ServerConfig(optimizer="sgd", lr=0.1, secret=secret)
    rng = random.Random(5)
    with (
        start_server(config, in_thread=True) as server,
        RemoteParameterServer(server.address, worker_id=0, secret=secret, timeout=30) as client,
    ):
        client.init("a", torch.zeros(3))
        client.init("b", torch.zeros(2, dtype=torch.float64))
        futures = []
        for i in range(40):
            key = "a" if i % 3 else "b"
            grad = torch.tensor([rng.uniform(-1, 1) for _ in range(3 if key == "a" else 2)])
            futures.append(client.push(key, grad.to(torch.float64) if key == "b" else grad))
        for f in futures:
            f.result()
        a, b = torch.empty(3), torch.empty(2, dtype=torch.float64)
        client.pull("a", a).result()
        client.pull("b", b).result()
        stats = client.stats()[0]["counters"]
    if monkeypatch is not None:
        monkeypatch.undo()
    bits = a.view(torch.int32).tolist() + b.view(torch.int64).tolist()
    return bits, {k: stats[k] for k in ("push_applied", "push_duplicate", "errors", "init")}


@pytest.mark.parametrize("secret", [None, "shh"])
def test_small_and_general_paths_leave_the_same_server_state(
    monkeypatch: pytest.MonkeyPatch, secret: str | None
) -> None:
    general = _run(monkeypatch, secret)
    lean = _run(None, secret)
    assert lean == general
    assert lean[1] == {"push_applied": 40, "push_duplicate": 0, "errors": 0, "init": 2}


@contextlib.contextmanager
def _raw_dealer(address: str) -> Iterator[zmq.Socket[bytes]]:
    """A bare DEALER to a server, for frames sent by hand; closed on exit."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.rcvtimeo = 10_000
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def test_a_retried_small_push_is_applied_once_and_answered_alike() -> None:
    secret = b"r" * 8
    config = ServerConfig(optimizer="sgd", lr=1.0, secret="r" * 8)
    with start_server(config, in_thread=True) as server, _raw_dealer(server.address) as sock:
        hello = Header(op=Op.HELLO, request_id=1, worker_id=4, session=77)
        sock.send_multipart(protocol.encode(hello, "", None, secret=secret))
        incarnation = protocol.decode(sock.recv_multipart(), secret=secret).header.incarnation
        init = Header(
            op=Op.INIT, request_id=2, worker_id=4, session=77, seq=1, incarnation=incarnation
        )
        sock.send_multipart(protocol.encode(init, "k", torch.zeros(1), secret=secret))
        assert protocol.decode(sock.recv_multipart(), secret=secret).header.status == 0
        push = small.pack_request(
            Op.PUSH, "k", torch.ones(1), b"", 0, 4, 3, 77, 2, incarnation, 5000, secret
        )
        assert push is not None
        replies = []
        for _ in range(2):  # the same request twice: a retry
            sock.send(push)
            replies.append(sock.recv())
        assert replies[0] == replies[1]
        assert small.read_ack(replies[0], secret) == (Op.PUSH, Status.OK, 3, incarnation, 2)
        stats = Header(op=Op.STATS, request_id=4, worker_id=4, session=77)
        sock.send_multipart(protocol.encode(stats, "", None, secret=secret))
        report = json.loads(protocol.decode(sock.recv_multipart(), secret=secret).text())
    assert report["counters"]["push_applied"] == 1
    assert report["counters"]["push_duplicate"] == 1


class _OwnSGD(torch.optim.SGD):
    """An optimizer class outside torch.optim: it might keep the gradient it is given."""


def test_store_small_grad_gives_apply_the_same_bits_in_one_tensor_per_key() -> None:
    spec = OptimizerSpec.of("sgd", lr=0.1)
    store, reference = ParameterStore(spec), ParameterStore(spec)
    for s in (store, reference):
        s.init("k", torch.zeros(3))
        s.init("wide", torch.zeros(65))
        s.init("half", torch.zeros(2, dtype=torch.float16))
    gen = torch.Generator().manual_seed(3)
    kept = set()
    for _ in range(5):
        grad = torch.randn(3, generator=gen)
        got = store.small_grad("k", torch.float32, (3,), memoryview(grad.numpy()).cast("B"))
        assert got is not None and torch.equal(got, grad)
        kept.add(got.data_ptr())
        store.apply("k", got)
        reference.apply("k", grad)
    assert len(kept) == 1  # filled in place: no tensor made per push
    assert torch.equal(store.value("k"), reference.value("k"))

    def small_grad(
        key: str, values: list[float], shape: tuple[int, ...] = (3,), dtype=torch.float32
    ):
        data = torch.tensor(values, dtype=dtype).numpy().tobytes()
        return store.small_grad(key, dtype, shape, data)

    assert small_grad("k", [1.0, float("nan"), 0.0]) is None  # the general path refuses it
    assert small_grad("k", [1.0, 2.0, float("-inf")]) is None
    assert small_grad("k", [1.0, 2.0, 3.0], dtype=torch.float64) is None  # unlike the value
    assert small_grad("k", [1.0, 2.0, 3.0], shape=(1, 3)) is None
    assert small_grad("k", [1.0, 2.0]) is None  # the bytes of another size
    assert small_grad("wide", [0.0] * 65, shape=(65,)) is None  # too many to read in Python
    assert small_grad("half", [1.0, 2.0], shape=(2,), dtype=torch.float16) is None
    assert small_grad("unknown", [1.0, 2.0, 3.0]) is None
    assert torch.equal(store.value("k"), reference.value("k"))  # none of these changed it

    own = ParameterStore(lambda params: _OwnSGD(params, lr=0.1))
    own.init("k", torch.zeros(3))
    assert own.small_grad("k", torch.float32, (3,), bytes(12)) is None


def test_a_push_is_answered_before_its_update_only_where_that_cannot_fail() -> None:
    # plain_update says when the server may answer a small push first (Service._push).
    stores = {
        "sgd": ParameterStore(OptimizerSpec.of("sgd", lr=0.1)),
        "none": ParameterStore(None),
        "momentum": ParameterStore(OptimizerSpec.of("sgd", lr=0.1, momentum=0.9)),
        "adam": ParameterStore(OptimizerSpec.of("adam", lr=0.1)),
    }
    for store in stores.values():
        store.init("k", torch.zeros(2))
    assert {name: s.plain_update("k") for name, s in stores.items()} == {
        "sgd": True,
        "none": True,
        "momentum": False,
        "adam": False,
    }
    restored = ParameterStore(OptimizerSpec.of("sgd", lr=0.1))
    restored.init("k", torch.zeros(2))
    assert restored.plain_update("k")
    stores["sgd"].set_hyperparameters("k", {"momentum": 0.5})  # a worker's schedule
    assert not stores["sgd"].plain_update("k")
    restored.load_state_dict(stores["sgd"].state_dict())  # a checkpoint's settings
    assert not restored.plain_update("k")


def test_a_small_push_holding_nan_is_refused_by_the_server_and_changes_nothing() -> None:
    config = ServerConfig(optimizer="sgd", lr=1.0)
    with start_server(config, in_thread=True) as server, _raw_dealer(server.address) as sock:
        sock.send_multipart(
            protocol.encode(Header(op=Op.HELLO, request_id=1, worker_id=2, session=5), "", None)
        )
        incarnation = protocol.decode(sock.recv_multipart()).header.incarnation
        init = Header(
            op=Op.INIT, request_id=2, worker_id=2, session=5, seq=1, incarnation=incarnation
        )
        sock.send_multipart(protocol.encode(init, "k", torch.zeros(2)))
        assert protocol.decode(sock.recv_multipart()).header.status == Status.OK
        statuses = []
        for seq, grad in ((2, [float("nan"), 1.0]), (3, [0.5, 1.0])):
            push = small.pack_request(
                Op.PUSH,
                "k",
                torch.tensor(grad),
                b"",
                0,
                2,
                seq + 1,
                5,
                seq,
                incarnation,
                0,
                None,
            )
            assert push is not None
            sock.send(push)
            statuses.append(protocol.decode([sock.recv()]).header.status)
        pull = Header(op=Op.PULL, request_id=9, worker_id=2, session=5, incarnation=incarnation)
        sock.send_multipart(protocol.encode(pull, "k", None))
        value = protocol.decode(sock.recv_multipart()).tensor()
    assert statuses == [Status.NON_FINITE, Status.OK]
    assert value.tolist() == [-0.5, -1.0]  # the finite push alone, applied once


def _sync_rounds(monkeypatch: pytest.MonkeyPatch | None) -> list[int]:
    """Three rounds of two workers' small pushes on a sync server; the bits pulled."""
    if monkeypatch is not None:
        monkeypatch.setattr(ParameterStore, "small_grad", lambda *a: None)
    config = ServerConfig(optimizer="sgd", lr=0.5, mode="sync", workers=2, heartbeat_timeout=60)
    gen = torch.Generator().manual_seed(8)
    with start_server(config, in_thread=True) as server:
        clients = [RemoteParameterServer(server.address, worker_id=w, timeout=30) for w in (0, 1)]
        try:
            clients[0].init("k", torch.zeros(4))
            for _ in range(3):
                futures = [c.push("k", torch.randn(4, generator=gen)) for c in clients]
                for f in futures:
                    f.result()
            out = torch.empty(4)
            clients[0].pull("k", out).result()
        finally:
            for c in clients:
                c.close()
    if monkeypatch is not None:
        monkeypatch.undo()
    return out.view(torch.int32).tolist()


def test_sync_rounds_keep_each_worker_s_small_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    # A round keeps every worker's gradient until it ends, in a sum of its own: a
    # round that kept the store's tensor, refilled by the next push, would differ.
    assert _sync_rounds(None) == _sync_rounds(monkeypatch)
