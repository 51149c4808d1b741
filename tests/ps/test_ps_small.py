"""The small-message path (``gradhub.ps.protocol.small`` and its callers) against
the general one: the same bytes on the wire, the same checks, the same server
state and replies, and exactly-once kept for a retried small push."""

from __future__ import annotations

import json
import random

import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from gradhub import RemoteParameterServer, ServerConfig, start_server
from gradhub.errors import ProtocolError
from gradhub.ps import protocol
from gradhub.ps.dedupe import Ledger
from gradhub.ps.protocol import FLAG_REPLY, Header, Op, Status, small
from gradhub.ps.protocol.message import DTYPES

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


def test_a_retried_small_push_is_applied_once_and_answered_alike() -> None:
    secret = b"r" * 8
    config = ServerConfig(optimizer="sgd", lr=1.0, secret="r" * 8)
    with start_server(config, in_thread=True) as server:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvtimeo = 10_000
        sock.connect(server.address)
        try:
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
        finally:
            sock.close(0)
            ctx.term()
    assert report["counters"]["push_applied"] == 1
    assert report["counters"]["push_duplicate"] == 1
