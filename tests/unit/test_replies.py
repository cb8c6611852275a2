"""Done replies: the daemon's typed replies put the same bytes on the wire as the dicts it filled by hand
before (protocol 2), every reply survives a Done frame, and the reader rejects a missing or mistyped field."""

from __future__ import annotations

import dataclasses
import gc
from typing import Any

import msgpack
import pytest

from hkvd.transport.codec import FrameDecoder, decode_body, encode
from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.wire import control, events, kv, peer
from hkvd.transport.wire.replies import (
    ANSWERS,
    REPLIES,
    Acknowledged,
    PullResult,
    QuarantineLifted,
    Reply,
    RetrieveResult,
    StepResult,
    StoreResult,
    Unpinned,
    VerifyResult,
)

EVENT = b"e" * 64  # a CUDA IPC event handle's size


# ---- the info dicts exactly as the daemon built them before the typed replies (git show 1863f33) --------------
def _old_store(stored: int, skipped: int, dropped: int, thinned: int) -> dict[str, Any]:
    return {"stored": stored, "skipped": skipped, "dropped": dropped, "thinned": thinned}  # service._write_items


def _old_retrieve(entries: int, done_event: bytes) -> dict[str, Any]:
    info: dict[str, Any] = {"entries": entries}  # service._retrieve
    if done_event:
        info["event"] = done_event
    return info


def _old_step(outcome: str, counts: tuple[int, int, int, int] | None) -> dict[str, Any]:
    if counts is None:  # service._step_event: no copy started
        return {"outcome": outcome}
    info = _old_store(*counts)
    info["outcome"] = outcome
    return info


def _old_pull(nbytes: int, hit: int, lease: int, ttl: float, pulled: int, local: int, seconds: float,
              timings: tuple[float, float, int] | None) -> tuple[int, dict[str, Any]]:
    result = {"nbytes": nbytes, "hit_chunks": hit, "lease_id": lease, "lease_ttl_s": ttl, "pulled": pulled,
              "local": local, "seconds": seconds}  # peer_client._answer
    if timings is not None:  # peer_client.pull: the pull read from the peer
        result.update(lookup_s=timings[0], read_s=timings[1], descs=timings[2])
    return result.pop("nbytes"), result  # peers._pull


# (new reply, (nbytes, info) as before): every shape the daemon sends, optional groups present and absent.
CASES: list[tuple[Reply, tuple[int, dict[str, Any]]]] = [
    (StoreResult(4096, 3, 1, 0, 2), (4096, _old_store(3, 1, 0, 2))),
    (StoreResult(0, 0, 0, 5, 0), (0, _old_store(0, 0, 5, 0))),
    (RetrieveResult(8192, 2), (8192, _old_retrieve(2, b""))),
    (RetrieveResult(8192, 2, EVENT), (8192, _old_retrieve(2, EVENT))),
    (RetrieveResult(8192, 2, b"", 0.0015), (8192, {**_old_retrieve(2, b""), "seconds": 0.0015})),
    (StepResult(0, "gap"), (0, _old_step("gap", None))),
    (StepResult(512, "accept", 1, 0, 0, 0), (512, _old_step("accept", (1, 0, 0, 0)))),
    (StepResult.after_copy("late", StoreResult(0, 0, 2, 0, 1)), (0, _old_step("late", (0, 2, 0, 1)))),
    (PullResult(0, 4, 17, 30.0, 0, 4, 0.000123), _old_pull(0, 4, 17, 30.0, 0, 4, 0.000123, None)),
    (PullResult(1 << 20, 4, 18, 30.0, 3, 1, 0.25, 0.001, 0.2, 7),
     _old_pull(1 << 20, 4, 18, 30.0, 3, 1, 0.25, (0.001, 0.2, 7))),
    (VerifyResult(1 << 20, 4, 1, 0, 0.5, True),
     (1 << 20, {"checked": 4, "diverged": 1, "missing": 0, "max_error": 0.5, "quarantined": True})),
    (QuarantineLifted(0, "00ff/1,00ff/2"), (0, {"lifted": "00ff/1,00ff/2"})),
    (Unpinned(0, 2), (0, {"unpinned": 2})),
    (Acknowledged(), (0, {})),  # service: Unregister
]
IDS = [f"{type(r).__name__}-{i}" for i, (r, _) in enumerate(CASES)]


def _through_the_wire(done: kv.Done) -> kv.Done:
    frames = FrameDecoder().feed(encode(done))
    got = decode_body(frames[0])
    assert isinstance(got, kv.Done)
    return got


def test_every_reply_type_has_a_case_and_answers_its_request():
    assert {type(r) for r, _ in CASES} == set(REPLIES.values())
    assert {c.__name__ for c in Reply.__subclasses__()} == {c.__name__ for c in REPLIES.values()}
    answers = {kv.Store: StoreResult, kv.Retrieve: RetrieveResult, events.StepEvent: StepResult,
               peer.Pull: PullResult, kv.Verify: VerifyResult, control.LiftQuarantine: QuarantineLifted,
               control.Unregister: Acknowledged, control.Unpin: Unpinned}
    assert answers == REPLIES


@pytest.mark.parametrize(("reply", "old"), CASES, ids=IDS)
def test_the_wire_bytes_are_those_of_the_hand_filled_dicts(reply, old):
    nbytes, info = old
    new = reply.to_done(9)
    assert new == kv.Done(9, nbytes, info)
    # The same keys in the same order (a msgpack map keeps it) with the same types: the same bytes.
    assert [(k, type(v)) for k, v in new.info.items()] == [(k, type(v)) for k, v in info.items()]
    assert encode(new) == encode(kv.Done(9, nbytes, info))


@pytest.mark.parametrize(("reply", "old"), CASES, ids=IDS)
def test_every_reply_round_trips_through_a_done_frame(reply, old):
    done = _through_the_wire(reply.to_done(5))
    assert done.req_id == 5
    assert type(reply).from_done(done.nbytes, done.info) == reply


# The fields a reader must find, per reply: the rest have defaults (module docstring of replies.py).
REQUIRED = {
    StoreResult: ("stored", "skipped", "dropped", "thinned"),
    RetrieveResult: ("entries",),
    StepResult: ("outcome",),
    PullResult: ("hit_chunks", "lease_id", "lease_ttl_s", "pulled", "local", "seconds"),
    VerifyResult: ("checked", "diverged", "missing", "max_error", "quarantined"),
    QuarantineLifted: ("lifted",),
    Unpinned: ("unpinned",),
    Acknowledged: (),
}
FULL = [CASES[0][0], CASES[3][0], CASES[5][0], CASES[8][0]]  # every optional group present


def _frame_with(reply: Reply, change: Any) -> kv.Done:
    """``reply``'s Done frame, its info changed by ``change`` after msgpack encoding and decoding: as a
    daemon of another version would send it."""
    wire = msgpack.unpackb(msgpack.packb(reply.to_done(3).to_wire(), use_bin_type=True), raw=False)
    change(wire[3])
    return _through_the_wire(kv.Done(*wire[1:]))


@pytest.mark.parametrize("reply", FULL, ids=lambda r: type(r).__name__)
def test_a_missing_field_is_a_protocol_violation_naming_the_request_and_field(reply):
    cls = type(reply)
    assert set(REQUIRED[cls]) <= set(reply.to_info())
    for key in REQUIRED[cls]:
        done = _frame_with(reply, lambda info, key=key: info.pop(key))
        with pytest.raises(ProtocolViolation, match=f"reply to a {cls.what} lacks '{key}'"):
            cls.from_done(done.nbytes, done.info)
    for key in set(reply.to_info()) - set(REQUIRED[cls]):  # an optional field left out takes its default
        done = _frame_with(reply, lambda info, key=key: info.pop(key))
        default = {f.name: f.default for f in dataclasses.fields(cls)}[key]
        assert getattr(cls.from_done(done.nbytes, done.info), key) == default


@pytest.mark.parametrize("reply", FULL, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("wrong", ["7", True, None, [1]], ids=["str", "bool", "nil", "array"])
def test_a_mistyped_field_is_a_protocol_violation_naming_the_request_and_field(reply, wrong):
    cls = type(reply)
    for key, value in reply.to_info().items():
        if isinstance(value, str) and isinstance(wrong, str):
            continue  # a string is a StepResult.outcome
        done = _frame_with(reply, lambda info, key=key: info.__setitem__(key, wrong))
        with pytest.raises(ProtocolViolation, match=f"reply to a {cls.what}: '{key}' is {type(wrong).__name__}"):
            cls.from_done(done.nbytes, done.info)


def test_extra_keys_are_ignored_and_an_int_is_taken_as_a_float():
    assert StoreResult.from_done(10, {"stored": 2, "skipped": 1, "dropped": 0, "thinned": 3, "new": 1}) == \
        StoreResult(10, 2, 1, 0, 3)  # a key a newer daemon adds is ignored
    assert RetrieveResult.from_done(5, {"entries": 2}) == RetrieveResult(5, 2, b"")
    assert StepResult.from_done(0, {"outcome": "gap"}) == StepResult(0, "gap")
    pulled = PullResult.from_done(7, {"hit_chunks": 3, "lease_id": 9, "lease_ttl_s": 30, "pulled": 2, "local": 1,
                                      "seconds": 0.5})
    assert pulled.lease_ttl_s == 30.0 and isinstance(pulled.lease_ttl_s, float)
    assert Acknowledged.from_done(0, {"anything": 1}) == Acknowledged()


@pytest.mark.parametrize(("cls", "info", "match"), [
    (StoreResult, {"stored": 1, "skipped": 0, "dropped": 0}, "lacks 'thinned'"),
    (RetrieveResult, {"entries": "2"}, "'entries' is str, not int"),
    (StepResult, {"outcome": "gap", "stored": True}, "'stored' is bool"),
    (PullResult, {}, "reply to a pull lacks 'hit_chunks'"),
])
def test_a_reply_missing_or_mistyping_a_field_is_a_protocol_violation(cls, info, match):
    with pytest.raises(ProtocolViolation, match=match):
        cls.from_done(0, info)


# ---- the one codec: a reply declared with its fields needs no code of its own -----------------------------------
@pytest.fixture
def forget_probes():
    """The test's Reply subclasses gone once it ends (Reply.__subclasses__ must list only the real ones)."""
    yield
    gc.collect()


def test_a_reply_declared_by_its_fields_alone_round_trips_with_its_groups(forget_probes):
    @dataclasses.dataclass(frozen=True, slots=True)
    class Probe(Reply):
        what = "probe"
        WIRE = (("b", "c"), ("a",))
        nbytes: int
        a: str
        b: int = 0
        c: float = 0.0

    assert Probe(1, "x").to_done(2) == kv.Done(2, 1, {"a": "x"})  # the group at its defaults is left out whole
    assert list(Probe(1, "x", 0, 0.5).to_info().items()) == [("b", 0), ("c", 0.5), ("a", "x")]  # WIRE's order
    for reply in (Probe(1, "x"), Probe(3, "y", 4, 0.25)):
        done = _through_the_wire(reply.to_done(6))
        assert Probe.from_done(done.nbytes, done.info) == reply
    with pytest.raises(ProtocolViolation, match="reply to a probe: 'b' is str, not int"):
        Probe.from_done(0, {"a": "x", "b": "1"})
    with pytest.raises(ProtocolViolation, match="reply to a probe lacks 'a'"):
        Probe.from_done(0, {"b": 1})


def test_a_reply_declared_with_a_field_the_codec_cannot_carry_is_refused(forget_probes):
    @dataclasses.dataclass(frozen=True, slots=True)
    class Listy(Reply):
        what = "listy"
        nbytes: int
        keys: list[bytes]

    with pytest.raises(TypeError, match=r"Listy\.keys: a reply field is one of"):
        Listy(0, []).to_info()

    @dataclasses.dataclass(frozen=True, slots=True)
    class Unnamed(Reply):
        what = "unnamed"
        WIRE = (("a",),)
        nbytes: int
        a: int
        b: int = 0

    with pytest.raises(TypeError, match=r"Unnamed\.WIRE must name each field but nbytes once"):
        Unnamed.from_done(0, {"a": 1})


# ---- answer messages: the client's result is the message the daemon sent, checked against the request ----------
ANSWER_SAMPLES = [kv.LookupReply(1, 3, 4, 30.0), control.RegisterAck(1, 2, b"f" * 16, 256, 1, True),
                  events.KVEvents(1, 5, 0, [b"\x90"]), control.StatusReply(1, {"pool": {}}), control.Pong(1)]


def _client_answered(request: type, answer: Any) -> Any:
    from hkvd.shim.client import DaemonClient

    client = DaemonClient("/nonexistent", client_name="t", role="tool")
    client._outstanding[1] = request  # as _submit records a request it sent
    client._on_message(answer)
    (done,) = client.poll()
    assert done.req_id == 1 and client.outstanding == 0
    return done


def test_every_answer_message_is_the_result_of_its_request():
    assert {type(a) for a in ANSWER_SAMPLES} == set(ANSWERS.values())
    for request, answer_type in ANSWERS.items():
        (answer,) = [a for a in ANSWER_SAMPLES if type(a) is answer_type]
        done = _client_answered(request, decode_body(FrameDecoder().feed(encode(answer))[0]))
        assert done.ok and done.get(answer_type) == answer


def test_an_answer_to_another_request_is_a_protocol_violation():
    done = _client_answered(kv.Lookup, control.Pong(1))
    assert not done.ok
    with pytest.raises(ProtocolViolation, match="answered a Lookup with a Pong"):
        done.get(kv.LookupReply)
