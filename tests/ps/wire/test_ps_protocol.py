"""Wire format, exactly-once ledger, consistency accounting and server config: pure pieces."""

from __future__ import annotations

import logging
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gradhub.errors import AuthenticationError, OversizedError, ProtocolError, UnknownOpError
from gradhub.ps.server.config import ServerConfig, is_loopback
from gradhub.ps.server.consistency import Consistency
from gradhub.ps.server.dedupe import Ledger
from gradhub.ps.server.rejects import LOG_EVERY, REFUSALS_PER_SECOND, Rejects
from gradhub.ps.wire import protocol
from gradhub.ps.wire.protocol import Header, Op, Status

SECRET = b"s3cret"


def _frames(tensor: torch.Tensor | None = None, secret: bytes | None = None) -> list[bytes]:
    header = Header(op=Op.PUSH, request_id=7, worker_id=3, session=11, seq=5, priority=-2)
    return [bytes(memoryview(f)) for f in protocol.encode(header, "w", tensor, secret=secret)]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.bool]
)
def test_round_trip_every_dtype(dtype: torch.dtype) -> None:
    t = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    msg = protocol.decode(_frames(t, SECRET), secret=SECRET)
    h = msg.header
    assert (h.op, h.request_id, h.worker_id, h.session, h.seq, h.priority) == (
        Op.PUSH,
        7,
        3,
        11,
        5,
        -2,
    )
    assert msg.key == "w" and h.shape == (3, 4) and h.dtype == dtype
    assert torch.equal(msg.tensor(), t)


def test_zero_copy_both_ways() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    frames = protocol.encode(Header(op=Op.PUSH), "k", t)
    sent = frames[3]
    assert isinstance(sent, memoryview)  # a view of the tensor's memory, not a copy
    t[0] = 42.0
    assert struct.unpack_from("<f", sent)[0] == 42.0
    buf = bytearray(bytes(sent))
    msg = protocol.decode([frames[0], frames[1], frames[2], buf])
    received = msg.tensor()
    buf[0:4] = struct.pack("<f", 7.0)
    assert received[0].item() == 7.0  # the tensor is the frame's memory


def test_empty_and_scalar_tensors() -> None:
    for t in (torch.zeros(0, 3), torch.tensor(2.5)):
        msg = protocol.decode(_frames(t))
        assert msg.tensor().shape == t.shape and torch.equal(msg.tensor(), t)


def test_signature_checks() -> None:
    good = _frames(torch.ones(3), SECRET)
    protocol.decode(good, secret=SECRET)
    with pytest.raises(AuthenticationError):
        protocol.decode(good, secret=b"wrong")
    with pytest.raises(AuthenticationError):
        protocol.decode(_frames(torch.ones(3)), secret=SECRET)  # unsigned
    with pytest.raises(AuthenticationError):
        protocol.decode(good)  # signed, but no secret here
    tampered = list(good)
    tampered[3] = b"\x00" * len(good[3])
    with pytest.raises(AuthenticationError):
        protocol.decode(tampered, secret=SECRET)


def test_limits_and_malformed() -> None:
    big = _frames(torch.zeros(100))
    with pytest.raises(OversizedError):
        protocol.decode(big, max_payload=10)
    with pytest.raises(ProtocolError, match="frames"):
        protocol.decode(big[:2])
    bad_op = bytearray(big[0])
    bad_op[3] = 99
    with pytest.raises(UnknownOpError):
        protocol.decode([bytes(bad_op), *big[1:]])
    with pytest.raises(ProtocolError, match="header says"):
        protocol.decode([big[0], big[1], big[2], big[3][:-4]])
    with pytest.raises(ValueError, match="limit"):
        protocol.encode(Header(op=Op.PULL), "k" * 2000)


_frame = st.binary(max_size=200)


@settings(max_examples=400, deadline=None)
@given(st.lists(_frame, max_size=5))
def test_fuzz_random_frames_only_protocol_error(frames: list[bytes]) -> None:
    try:
        protocol.decode(frames, secret=None)
        protocol.decode(frames, secret=SECRET)
    except ProtocolError:
        pass


@settings(max_examples=400, deadline=None)
@given(
    frame=st.integers(0, 2),
    pos=st.integers(0, protocol.HEADER_SIZE - 1),
    value=st.integers(0, 255),
    secret=st.sampled_from([None, SECRET]),
)
def test_fuzz_mutated_valid_frames(frame: int, pos: int, value: int, secret: bytes | None) -> None:
    frames = [bytearray(f) for f in _frames(torch.arange(6.0).reshape(2, 3), secret)]
    target = frames[frame]
    if target:
        target[pos % len(target)] = value
    try:
        msg = protocol.decode(frames, secret=secret)
    except ProtocolError:
        return
    if msg.header.dtype is not None:
        assert msg.tensor().numel() * msg.tensor().element_size() == msg.header.payload_len


def _packed(tensor: torch.Tensor | None, secret: bytes | None = None, meta: bytes = b"") -> bytes:
    header = Header(op=Op.PUSH, request_id=7, worker_id=3, session=11, seq=5, priority=-2)
    frames = protocol.encode(header, "w", tensor, meta=meta, secret=secret, pack=True)
    assert len(frames) == 1
    return bytes(frames[0])


@pytest.mark.parametrize("secret", [None, SECRET])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bool])
def test_packed_round_trip(secret: bytes | None, dtype: torch.dtype) -> None:
    t = (torch.arange(12).reshape(3, 4) % 3).to(dtype)
    packed = _packed(t, secret, meta=b'{"a": 1}')
    msg = protocol.decode([packed], secret=secret)
    assert msg.header.flags & protocol.FLAG_PACKED and msg.key == "w"
    assert msg.meta_json() == {"a": 1} and torch.equal(msg.tensor(), t)
    # the same bytes as the four frames, so the same signature
    loose = _frames(t, secret)
    if secret:
        assert packed[-protocol.MAC_SIZE :] != loose[4]  # the header says "packed"
    assert packed[protocol.HEADER_SIZE :].startswith(loose[1])


def test_packed_only_when_small_and_checked() -> None:
    big = torch.zeros(protocol.PACK_MAX // 4 + 1)
    assert len(protocol.encode(Header(op=Op.PUSH), "k", big, pack=True)) == 4
    assert len(protocol.encode(Header(op=Op.PUSH), "k", big[:-1], pack=True)) == 1
    packed = _packed(torch.ones(3), SECRET)
    with pytest.raises(AuthenticationError):
        protocol.decode([packed], secret=b"wrong")
    tampered = bytearray(packed)
    tampered[-protocol.MAC_SIZE - 1] ^= 1  # a payload byte
    with pytest.raises(AuthenticationError):
        protocol.decode([bytes(tampered)], secret=SECRET)
    with pytest.raises(ProtocolError, match=r"too short|header says"):
        protocol.decode([packed[:-40]], secret=SECRET)
    with pytest.raises(ProtocolError, match="not packed"):
        protocol.decode([_frames(torch.ones(3))[0]])
    loose = protocol.encode(Header(op=Op.PUSH), "k", torch.ones(3))
    assert protocol.peek_header([packed]) is not None
    with pytest.raises(ProtocolError, match="packed"):
        protocol.decode([packed[: protocol.HEADER_SIZE], *loose[1:]])


@settings(max_examples=400, deadline=None)
@given(
    pos=st.integers(0, 400),
    value=st.integers(0, 255),
    cut=st.integers(0, 400),
    secret=st.sampled_from([None, SECRET]),
)
def test_fuzz_mutated_packed_frame(pos: int, value: int, cut: int, secret: bytes | None) -> None:
    frame = bytearray(_packed(torch.arange(6.0).reshape(2, 3), secret, meta=b"{}"))
    frame[pos % len(frame)] = value
    del frame[len(frame) - cut % 8 :]
    try:
        msg = protocol.decode([bytes(frame)], secret=secret)
    except ProtocolError:
        return
    if msg.header.dtype is not None:
        assert msg.tensor().numel() * msg.tensor().element_size() == msg.header.payload_len


def test_reply_header_mirrors_request() -> None:
    req = Header(op=Op.PULL, request_id=9, worker_id=2, session=4, seq=0, priority=3)
    rep = protocol.reply(req, incarnation=77, status=Status.UNKNOWN_KEY)
    msg = protocol.decode(protocol.encode(rep, "k", b"no such key"))
    assert msg.header.is_reply and msg.header.status == Status.UNKNOWN_KEY
    assert (msg.header.request_id, msg.header.incarnation) == (9, 77)
    assert msg.text() == "no such key"


def test_ledger_out_of_order_and_sessions() -> None:
    ledger = Ledger()
    for seq in (2, 1, 4):
        assert not ledger.applied(1, 100, seq)
        ledger.mark(1, 100, seq)
    assert ledger.applied(1, 100, 1) and ledger.applied(1, 100, 4)
    assert not ledger.applied(1, 100, 3) and ledger.low(1, 100) == 2
    restored = Ledger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.applied(1, 100, 4) and restored.low(1, 100) == 2
    restored.mark(1, 200, 1)  # a new client object for worker 1: numbering starts afresh
    assert not restored.applied(1, 100, 1) and restored.applied(1, 200, 1)


def test_sync_rounds_apply_once_when_all_live_pushed() -> None:
    c = Consistency("sync", workers=2)
    for w in (0, 1):
        c.seen(w, pushing=True, now=0.0)
    assert c.push(0, "k", torch.tensor([1.0])) == []
    assert not c.pull_ready(0, "k")
    assert c.push(0, "k", torch.tensor([10.0])) == []  # round 1 joins ahead
    (total,) = c.push(1, "k", torch.tensor([2.0]))
    assert total.item() == 3.0 and c.pull_ready(1, "k") and not c.pull_ready(0, "k")
    # worker 1 goes silent: round 1 completes with worker 0's gradient alone
    c.seen(0, now=5.0)
    assert c.expire(timeout=2.0, now=5.0) == [1]
    (total,) = c.complete_rounds("k")
    assert total.item() == 10.0 and c.pull_ready(0, "k")
    c.seen(1, now=6.0)  # rejoins at the current round
    assert c.pull_ready(1, "k") and c.steps["k"][1] == 2


def test_ssp_bound() -> None:
    c = Consistency("ssp", workers=2, max_staleness=1)
    c.seen(0, pushing=True)
    c.push(0, "k", torch.ones(1))
    assert c.pull_ready(0, "k")  # one ahead of the unregistered worker 1
    c.push(0, "k", torch.ones(1))
    assert not c.pull_ready(0, "k")
    c.seen(1, pushing=True)
    c.push(1, "k", torch.ones(1))
    assert c.pull_ready(0, "k")


def test_config_validation() -> None:
    assert is_loopback("tcp://127.0.0.1:5555") and is_loopback("tcp://[::1]:1")
    assert not is_loopback("tcp://0.0.0.0:5555") and not is_loopback("tcp://*:5555")
    with pytest.raises(ValueError, match="secret"):
        ServerConfig(bind="tcp://0.0.0.0:5555")
    assert ServerConfig(bind="tcp://0.0.0.0:5555", secret="x").secret == b"x"
    with pytest.raises(ValueError, match="optimizer"):
        ServerConfig(optimizer="lbfgs")
    with pytest.raises(ValueError, match="ssp"):
        ServerConfig(mode="sync", max_staleness=2)
    with pytest.raises(ValueError, match="threads"):
        ServerConfig(threads=0)


class _Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _bad_hello(request_id: int = 7) -> list[bytes]:
    frames = protocol.encode(Header(op=Op.HELLO, request_id=request_id, worker_id=1), secret=b"x")
    return [b"peer-identity", *(bytes(memoryview(f)) for f in frames)]


def _refusals(rejects: Rejects, hellos: int) -> int:
    bad = AuthenticationError("bad signature")
    return sum(rejects.reject(_bad_hello(), bad) is not None for _ in range(hellos))


def test_refusals_are_rate_limited_and_every_rejected_hello_counted() -> None:
    clock = _Clock()
    counters: dict[str, int] = {}
    rejects = Rejects(counters, clock=clock)
    burst = int(REFUSALS_PER_SECOND)
    assert _refusals(rejects, 5 * burst) == burst  # a burst: one second's worth answered
    assert _refusals(rejects, 5) == 0  # no time passed: none
    clock.now += 0.5
    assert _refusals(rejects, 5 * burst) == burst // 2  # refilled at the rate
    clock.now += 3600
    assert _refusals(rejects, 5 * burst) == burst  # the bucket holds at most one second's
    assert counters["refused"] == 2 * burst + burst // 2
    assert counters["dropped_unauthenticated"] == 15 * burst + 5
    clock.now += 1
    refusal = rejects.reject(_bad_hello(request_id=42), AuthenticationError("x"))
    assert refusal is not None and refusal[0] == b"peer-identity"
    assert protocol.refusal_request_id(refusal[1:]) == 42  # the client matches it to its hello


def test_only_hellos_that_fail_authentication_are_answered() -> None:
    rejects = Rejects({}, clock=_Clock())
    push = [b"id", *_frames(torch.ones(2), SECRET)]
    assert rejects.reject(push, AuthenticationError("bad signature")) is None
    assert rejects.reject(_bad_hello(), ProtocolError("malformed")) is None
    assert rejects.reject(_bad_hello(), OversizedError("big")) is None
    assert rejects.counters["dropped_unauthenticated"] == 1
    assert rejects.counters["dropped_malformed"] == rejects.counters["dropped_oversized"] == 1
    assert rejects.counters["refused"] == 0


def test_rejected_peers_are_logged_at_most_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    rejects = Rejects({}, clock=clock)
    with caplog.at_level(logging.WARNING, logger="gradhub.ps.server.rejects"):
        _refusals(rejects, 100)
        assert len(caplog.records) == 1  # the first at once, then none
        clock.now += LOG_EVERY / 2
        _refusals(rejects, 100)
        assert len(caplog.records) == 1
        clock.now += LOG_EVERY / 2
        _refusals(rejects, 1)
    assert len(caplog.records) == 2
    first, second = (r.getMessage() for r in caplog.records)
    assert "refused unauthenticated hello(s) from an unknown peer (1x)" in first
    assert "an unknown peer (200x)" in second  # every one since the first, this one too
