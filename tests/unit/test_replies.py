"""Replies: one form on the wire. Every request's reply is a message of its own whose fields travel as an array
(pinned here, type numbers included), in its request's family; the reader rejects a missing, mistyped or extra
field with a ``ProtocolViolation`` naming the message and the field; the shim's client completes each request
with the very message the daemon sent."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import msgpack
import pytest

from hkvd.transport.codec import FrameDecoder, decode_body, encode
from hkvd.transport.errors import ProtocolViolation, UnknownMessage
from hkvd.transport.wire import MESSAGE_CLASSES, PROTOCOL_VERSION, Message, control, events, kv, peer
from hkvd.transport.wire.message import message_from_wire
from hkvd.transport.wire.replies import REPLIES

EVENT = b"e" * 64  # a CUDA IPC event handle's size

# (reply, its array on the wire): every shape the daemon sends, optional trailing fields present and absent.
CASES: list[tuple[Message, list[Any]]] = [
    (control.Unregistered(9), [13, 9]),
    (control.QuarantineLifted(9, "00ff/1,00ff/2"), [14, 9, "00ff/1,00ff/2"]),
    (control.Unpinned(9, 2), [15, 9, 2]),
    (kv.StoreResult(9, 4096, 3, 1, 0, 2), [33, 9, 4096, 3, 1, 0, 2]),
    (kv.StoreResult(9, 0, 0, 0, 5, 0), [33, 9, 0, 0, 0, 5, 0]),  # required fields are sent at 0 too
    (kv.RetrieveResult(9, 8192, 2), [34, 9, 8192, 2]),  # a host engine's, not timed
    (kv.RetrieveResult(9, 8192, 2, EVENT), [34, 9, 8192, 2, EVENT]),
    (kv.RetrieveResult(9, 8192, 2, b"", 0.0015), [34, 9, 8192, 2, b"", 0.0015]),
    (kv.VerifyResult(9, 1 << 20, 4, 1, 0, 0.5, True), [35, 9, 1 << 20, 4, 1, 0, 0.5, True]),
    (kv.LeaseWritten(9), [36, 9]),
    (events.StepResult(9, 0, "gap"), [43, 9, 0, "gap"]),  # no copy ran: no counts
    (events.StepResult(9, 512, "accept", 1, 0, 0, 0), [43, 9, 512, "accept", 1]),
    (events.StepResult.after_copy("late", kv.StoreResult(9, 0, 0, 2, 0, 1)), [43, 9, 0, "late", 0, 2, 0, 1]),
    (peer.PullResult(9, 0, 4, 17, 30.0, 0, 4, 0.000123), [71, 9, 0, 4, 17, 30.0, 0, 4, 0.000123]),  # all local
    (peer.PullResult(9, 1 << 20, 4, 18, 30.0, 3, 1, 0.25, 0.001, 0.2, 7),
     [71, 9, 1 << 20, 4, 18, 30.0, 3, 1, 0.25, 0.001, 0.2, 7]),
]
IDS = [f"{type(r).__name__}-{i}" for i, (r, _) in enumerate(CASES)]
# The replies that are their request's own message since protocol 1, in the same form.
OLDER = [kv.LookupReply(9, 3, 4, 30.0), control.RegisterAck(9, 2, b"f" * 16, 256, 1, True),
         events.KVEvents(9, 5, 0, [b"\x90"]), control.StatusReply(9, {"pool": {}}), control.Pong(9)]
# Every field of each reply at a value other than its default (each one's strictness is checked).
FULL = [CASES[0][0], CASES[1][0], CASES[2][0], CASES[3][0], kv.RetrieveResult(9, 8192, 2, EVENT, 0.25), CASES[8][0],
        CASES[9][0], events.StepResult(9, 512, "accept", 1, 2, 3, 4), CASES[14][0]]


def _through_a_frame(msg: Message) -> Message:
    (body,) = FrameDecoder().feed(encode(msg))
    return decode_body(body)


# ---- the form: one array per reply, one reply type per request, in its request's family ----------------------
def test_every_reply_has_a_case_and_answers_exactly_one_request():
    assert {type(r) for r, _ in CASES} | {type(r) for r in OLDER} == set(REPLIES.values())
    assert {type(r) for r in FULL} == {type(r) for r, _ in CASES}
    assert len(set(REPLIES.values())) == len(REPLIES)  # the type alone says which request a reply answers
    pairs = {
        control.Register: control.RegisterAck, control.Unregister: control.Unregistered,
        control.Status: control.StatusReply, control.Ping: control.Pong,
        control.LiftQuarantine: control.QuarantineLifted, control.Unpin: control.Unpinned,
        kv.Lookup: kv.LookupReply, kv.Store: kv.StoreResult, kv.Retrieve: kv.RetrieveResult,
        kv.Verify: kv.VerifyResult, kv.WatchLease: kv.LeaseWritten,
        events.StepEvent: events.StepResult, events.KVEventsPoll: events.KVEvents, peer.Pull: peer.PullResult,
    }
    assert pairs == REPLIES


def _family(msg_type: int) -> str:
    """docs/design.md, "Wire": message types are append-only integers by family."""
    for name, (lo, hi) in {"control": (1, 19), "kv": (20, 39), "events": (40, 49), "peer": (60, 79)}.items():
        if lo <= msg_type <= hi:
            return name
    raise AssertionError(f"message type {msg_type} is in no family")


def test_each_reply_is_numbered_in_its_requests_family():
    for request, reply in REPLIES.items():
        assert _family(reply.TYPE) == _family(request.TYPE), (request.__name__, reply.__name__)


# Messages that are neither a request of REPLIES nor a reply: the handshakes, one-way messages, Abort (its AbortAck
# acknowledges only the abort) and Error (any request's failure).
UNPAIRED = {control.Hello, control.HelloAck, control.Bye, kv.Release, kv.Pin, kv.Hints, kv.Uncacheable, kv.Abort,
            kv.AbortAck, kv.Error, peer.PeerHello, peer.PeerChallenge, peer.PeerAuth, peer.PeerWelcome, peer.PeerLookup,
            peer.PeerLookupReply, peer.PeerRelease}


def test_every_message_type_is_a_request_its_reply_or_one_of_the_unpaired():
    paired = set(REPLIES) | set(REPLIES.values())
    assert not paired & UNPAIRED
    assert paired | UNPAIRED == set(MESSAGE_CLASSES.values())


def test_dones_number_is_retired_with_protocol_2():
    assert PROTOCOL_VERSION == 3
    assert 24 not in MESSAGE_CLASSES
    with pytest.raises(UnknownMessage, match="unknown message type 24"):
        message_from_wire([24, 1, 0, {"stored": 1}])  # a Done of protocol 2


@pytest.mark.parametrize(("reply", "wire"), CASES, ids=IDS)
def test_each_reply_is_an_array_of_its_fields(reply, wire):
    assert reply.to_wire() == wire
    assert encode(reply)[4:] == msgpack.packb(wire, use_bin_type=True)
    assert _through_a_frame(reply) == reply


def test_a_store_result_is_fourteen_bytes_where_its_done_with_an_info_map_was_forty_six():
    assert encode(kv.StoreResult(9, 4096, 3, 1, 0, 2)) == bytes.fromhex("0000000a" "97" "21" "09" "cd1000" "03010002")


@pytest.mark.parametrize("reply", OLDER, ids=lambda r: type(r).__name__)
def test_the_older_reply_messages_round_trip_as_before(reply):
    assert _through_a_frame(reply) == reply


# ---- strict reading: a missing, mistyped or extra field is a ProtocolViolation naming the message and field ----
def _fields(cls: type[Message]) -> list[tuple[str, Any, bool]]:
    """(name, type, required) of each field, in wire order."""
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name], f.default is dataclasses.MISSING)
            for f in dataclasses.fields(cls)]  # type: ignore[arg-type]


@pytest.mark.parametrize("reply", FULL, ids=lambda r: type(r).__name__)
def test_a_missing_field_is_a_protocol_violation_naming_the_message_and_field(reply):
    cls, wire = type(reply), reply.to_wire()
    for i, (name, _, required) in enumerate(_fields(cls)):
        cut = wire[:1 + i]  # the type, then the fields before ``name``
        if required:
            with pytest.raises(ProtocolViolation, match=rf"^{cls.__name__}: expected .* fields, got {i} "
                                                        rf"\(lacks '{name}'\)"):
                message_from_wire(cut)
        else:  # an optional field left out, and every one after it, takes its default
            got = message_from_wire(cut)
            assert getattr(got, name) == dataclasses.fields(cls)[i].default  # type: ignore[arg-type]


def _fits(value: Any, hint: Any) -> bool:
    return type(value) is hint or (hint is float and type(value) is int)


@pytest.mark.parametrize("reply", FULL, ids=lambda r: type(r).__name__)
@pytest.mark.parametrize("wrong", ["7", True, None, [1], 1.5, b"x" * 64, {"a": 1}],
                         ids=["str", "bool", "nil", "array", "float", "bin", "map"])
def test_a_mistyped_field_is_a_protocol_violation_naming_the_message_and_field(reply, wrong):
    cls, wire = type(reply), reply.to_wire()
    for i, (name, hint, _) in enumerate(_fields(cls)):
        if _fits(wrong, hint):
            continue
        bad = [*wire[:1 + i], wrong, *wire[2 + i:]]
        with pytest.raises(ProtocolViolation, match=rf"^{cls.__name__}\.{name}: expected "):
            message_from_wire(msgpack.unpackb(msgpack.packb(bad, use_bin_type=True), raw=False))


@pytest.mark.parametrize("reply", FULL, ids=lambda r: type(r).__name__)
def test_a_field_past_the_last_is_a_protocol_violation(reply):
    cls, n = type(reply), len(_fields(type(reply)))
    with pytest.raises(ProtocolViolation, match=rf"^{cls.__name__}: expected .*{n} fields, got {n + 1}$"):
        message_from_wire([*reply.to_wire(), 0])


def test_an_integer_is_taken_as_a_float_and_a_bad_event_handle_is_refused():
    pulled = message_from_wire([71, 9, 0, 4, 17, 30, 0, 4, 1])
    assert isinstance(pulled, peer.PullResult) and pulled == peer.PullResult(9, 0, 4, 17, 30.0, 0, 4, 1.0)
    assert type(pulled.lease_ttl_s) is float and type(pulled.seconds) is float
    with pytest.raises(ProtocolViolation, match=r"RetrieveResult\.event: a CUDA IPC event handle is 64 bytes"):
        message_from_wire([34, 9, 8192, 2, b"short"])


# ---- the shim's client: the result is the message the daemon sent, checked against the request ----------------
def _client_answered(request: type, reply: Any) -> Any:
    from hkvd.shim.client import DaemonClient

    client = DaemonClient("/nonexistent", client_name="t", role="tool")
    client._outstanding[1] = request  # as _submit records a request it sent
    client._on_message(reply)
    (done,) = client.poll()
    assert done.req_id == 1 and client.outstanding == 0
    return done


def _as_request_1(reply: Message) -> Message:
    return dataclasses.replace(reply, req_id=1)  # type: ignore[type-var]


@pytest.mark.parametrize("reply", [r for r, _ in CASES] + OLDER, ids=lambda r: type(r).__name__)
def test_every_reply_is_the_result_of_its_request(reply):
    (request,) = [q for q, a in REPLIES.items() if a is type(reply)]
    sent = _as_request_1(reply)
    done = _client_answered(request, _through_a_frame(sent))
    assert done.ok and done.get(type(reply)) == sent


@pytest.mark.parametrize(("asked", "reply", "names"), [
    (kv.Lookup, control.Pong(1), "a Lookup with a Pong"),
    (kv.Store, kv.RetrieveResult(1, 0, 0), "a Store with a RetrieveResult"),
    (kv.WatchLease, kv.StoreResult(1, 0, 0, 0, 0, 0), "a WatchLease with a StoreResult"),
])
def test_a_reply_to_another_request_is_a_protocol_violation(asked, reply, names):
    done = _client_answered(asked, reply)
    assert not done.ok
    with pytest.raises(ProtocolViolation, match=f"answered {names}; run hkvd serve and the shim"):
        done.get(REPLIES[asked])


def test_a_reply_to_no_request_of_the_clients_is_ignored():
    from hkvd.shim.client import DaemonClient

    client = DaemonClient("/nonexistent", client_name="t", role="tool")
    client._on_message(kv.StoreResult(5, 0, 0, 0, 0, 0))  # never sent, or already failed
    assert client.poll() == [] and client.outstanding == 0
