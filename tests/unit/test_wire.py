"""Wire: every message round-trips, bad fields are typed errors, frames are bounded."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hkvd.transport.codec import FrameDecoder, decode_body, encode
from hkvd.transport.errors import (
    ErrorCode,
    FrameTooLarge,
    KVError,
    NotFound,
    ProtocolViolation,
    UnknownKVError,
    error_from_wire,
)
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire import MESSAGE_CLASSES, Message, MsgType, control, events, kv, peer

KEY = b"k" * 16
SAMPLES = [
    control.Hello(1, "x", "worker"), control.HelloAck(1, 2, 3, "s"), control.Register(1, {"a": 1}),
    control.RegisterAck(1, 2, b"f" * 16, 256), control.Unregister(3), control.Bye("r"), control.Status(4),
    control.StatusReply(4, {"x": [1]}), control.Ping(5), control.Pong(5),
    control.LiftQuarantine(6, "0123abcd"), control.Unpin(7, "session-1"), control.Unregistered(3),
    control.QuarantineLifted(6, "0123abcd/0"), control.Unpinned(7, 2),
    kv.Lookup(1, [KEY], True), kv.LookupReply(1, 3, 4, 30.0), kv.Store(2, [kv.Item(0, 0, KEY, [1, 2])]),
    kv.Retrieve(3, 9, [kv.Item(1, 0, KEY, [5])]), kv.Verify(4, [kv.Item(2, 1, KEY, [7], KEY)]),
    kv.Pin("session-1", "salt:0123abcd", 300.0, [KEY]),
    kv.Hints("", [KEY], ["pin"], [30.0], ["s"], {"pin/accepted": 1}),
    kv.Store(8, [], b"", None, "lora:adapter"),
    kv.StoreResult(2, 100, 1, 0, 0, 0), kv.RetrieveResult(3, 100, 1, b"e" * 64, 0.25),
    kv.VerifyResult(4, 100, 1, 0, 0, 0.0, False), kv.LeaseWritten(4), kv.Abort(2), kv.AbortAck(2),
    kv.Error(2, 20, "m"), kv.Release(9), kv.WatchLease(4, 9), kv.Uncacheable("unknown_extra_key_x"),
    events.StepEvent(1, 0, 5, [kv.Item(1, 3, KEY, [7])], [2, 3]),
    events.StepEvent(1, 1, 6, [], [], b"", None, [kv.Item(1, 4, KEY, [8])]),
    events.StepResult(1, 0, "gap"), events.StepResult(1, 4096, "accept", 1, 0, 0, 0),
    events.KVEventsPoll(6, 17), events.KVEvents(6, 19, 1, [b"\x92\xcb" + bytes(8) + b"\x90"]),
    peer.PeerHello(1, "node", b"n" * 32), peer.PeerChallenge(1, "node", b"s" * 32, b"p" * 32),
    peer.PeerAuth(b"p" * 32, [b"f" * 16]), peer.PeerWelcome("agent", b"md", [b"f" * 16], 30.0),
    peer.PeerLookup(1, b"f" * 16, [KEY], 1, 0.5, 0),
    peer.PeerLookupReply(1, 1, 2, 30.0, *peer.pack_entries([peer.RemoteEntry(0, 0, 10, [(4096, 4), (8192, 6)])])),
    peer.PeerRelease(2, 2),
    peer.Pull(3, "10.0.0.5:7470", [KEY], 0, 0), peer.PullResult(3, 4096, 1, 8, 30.0, 1, 0, 0.01, 0.002, 0.007, 2),
]


def test_every_message_type_has_a_sample():
    assert {type(m).TYPE for m in SAMPLES} == set(MESSAGE_CLASSES) == set(MsgType)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = FrameDecoder().feed(encode(msg))
    assert decode_body(frames[0]) == msg


def test_decoder_handles_split_and_joined_frames():
    data = b"".join(encode(m) for m in SAMPLES)
    dec = FrameDecoder()
    got = []
    for i in range(0, len(data), 7):
        got += [decode_body(b) for b in dec.feed(data[i:i + 7])]
    assert got == SAMPLES


def test_oversized_length_is_refused_before_buffering():
    with pytest.raises(FrameTooLarge):
        FrameDecoder(max_frame_bytes=1024).feed((2048).to_bytes(4, "big"))


@given(st.binary(max_size=200))
def test_garbage_never_crashes_the_decoder(data):
    with contextlib.suppress(KVError):
        decode_body(data)


NOTE = [KEY, [2**64 - 1, 7], b"\x01" * 32, bytes(4 * 32), [None, ["lora-a", ["mm-id", 3]]], 3, "lora-a"]


def test_notes_and_the_events_mode_ride_on_as_optional_trailing_fields():
    for msg in (kv.Store(2, [kv.Item(0, 0, KEY, [1, 2])], b"", [NOTE]),
                events.StepEvent(1, 0, 5, [kv.Item(1, 3, KEY, [7])], [], b"", [NOTE]),
                control.RegisterAck(1, 2, b"f" * 16, 256, control.KV_EVENTS_PUBLISHED)):
        assert decode_body(FrameDecoder().feed(encode(msg))[0]) == msg
    # Without notes, nothing is added to what an older daemon parses.
    assert kv.Store(2, [kv.Item(0, 0, KEY, [1, 2])]).to_wire() == [int(MsgType.STORE), 2, [[0, 0, KEY, [1, 2]]]]
    # A field with a default factory left at it is not sent either: older daemons parse the frame.
    assert events.StepEvent(1, 0, 5, [], [2]).to_wire() == [int(MsgType.STEP_EVENT), 1, 0, 5, [], [2]]
    assert kv.Store(2, [kv.Item(0, 0, KEY, [1, 2])], b"", [NOTE]).parsed_notes()[0].lora_name == "lora-a"


@pytest.mark.parametrize("note", [
    NOTE[:6],                                          # too short
    [KEY[:8], *NOTE[1:]],                              # short key
    [KEY, [], *NOTE[2:]],                              # no hashes
    [KEY, [2**64], *NOTE[2:]],                         # a hash past 64 bits
    [KEY, [-1], *NOTE[2:]],                            # a negative hash
    [KEY, [b""], *NOTE[2:]],                           # an empty hash
    [KEY, [True], *NOTE[2:]],                          # a bool hash
    [KEY, [b"h" * 65], *NOTE[2:]],                     # an oversized hash
    [KEY, NOTE[1], "p", *NOTE[3:]],                    # a parent of another type
    [*NOTE[:3], bytes(6), *NOTE[4:]],                  # tokens not uint32
    [*NOTE[:3], [1, 2], *NOTE[4:]],                    # tokens as a list
    [*NOTE[:4], [None], *NOTE[5:]],                    # extra keys not one per block
    [*NOTE[:4], [None, ["x" * 5000]], *NOTE[5:]],      # an oversized extra key
    [*NOTE[:4], [None, [{"a": 1}]], *NOTE[5:]],        # a map among extra keys
    [*NOTE[:4], [None, [[1, [2]]]], *NOTE[5:]],        # nested too deep
    [*NOTE[:5], -3, NOTE[6]],                          # a negative lora_id
    [*NOTE[:6], 7],                                    # lora_name not a string
], ids=str)
def test_bad_notes_are_refused_when_decoded(note):
    with pytest.raises(ProtocolViolation):
        kv.Store.from_wire([2, [[0, 0, KEY, [1, 2]]], b"", [note]])
    with pytest.raises(ProtocolViolation):
        events.StepEvent.from_wire([1, 0, 5, [[1, 3, KEY, [7]]], [], b"", [note]])


def test_event_groups_are_optional_and_checked():
    wire = _spec_wire(2, 1)
    assert control.EngineSpec.from_wire(wire).event_groups == []
    named = {**wire, "event_groups": [[0, "sliding_window", 192], [1, "full_attention", None]]}
    assert control.EngineSpec.from_wire(named).event_groups == [(0, "sliding_window", 192), (1, "full_attention", None)]
    for bad in ([[0, "x", None]], [[0, "", None], [1, "x", None]], [[0, "x", -1], [1, "x", None]], [[0, "x"]]):
        with pytest.raises(ProtocolViolation):
            control.EngineSpec.from_wire({**wire, "event_groups": bad})


def test_step_event_offers_name_one_block():
    with pytest.raises(ProtocolViolation):
        events.StepEvent.from_wire([1, 0, 0, [[1, 0, KEY, [1, 2]]], []])


def test_error_registry():
    assert isinstance(error_from_wire(ErrorCode.NOT_FOUND, "x"), NotFound)
    e = error_from_wire(12345, "new")
    assert isinstance(e, UnknownKVError) and e.raw_code == 12345


def test_chunk_keys_are_a_stable_rolling_prefix_hash():
    toks = list(range(1000))
    a = chunk_keys(toks, 256)
    assert len(a) == 3 and all(len(k) == 16 for k in a)
    assert chunk_keys(toks[:600], 256) == a[:2]  # same prefix, same keys
    b = chunk_keys([1, *toks[1:]], 256)
    assert all(x != y for x, y in zip(a, b, strict=True))  # a change early changes every later key
    assert chunk_keys(toks, 256) == a
    big = [0, 2**32 - 1, 70_000] * 100  # a list goes through array, an ndarray through NumPy: the same bytes
    assert chunk_keys(big, 100) == chunk_keys(np.asarray(big, dtype=np.int64), 100)
    for bad in ([-1] * 256, [2**32] * 256):
        with pytest.raises(OverflowError):
            chunk_keys(bad, 256)


@pytest.mark.parametrize("item", [
    [True, 0, KEY, [1]],            # group_id a bool
    [0, 0.0, KEY, [1]],             # chunk_index a float
    [0, -1, KEY, [1]],              # negative chunk_index
    [0, 0, KEY[:8], [1]],           # short key
    [0, 0, KEY, []],                # no blocks
    [0, 0, KEY, [False]],           # the one block a bool
    [0, 0, KEY, [1, 2.5]],          # a float among blocks
    [0, 1, KEY, [1], b"p"],         # short parent
    [0, 0, KEY, [1], KEY],          # chunk 0 with a parent
    [0, 0, KEY],                    # too short
    (0, 0, KEY, [1]),               # not a list
], ids=str)
@pytest.mark.parametrize("cls", [kv.Store, kv.Retrieve])
def test_bad_items_are_refused_when_decoded(cls, item):
    def fields(items: list) -> list:
        return [1, items] if cls is kv.Store else [1, 2, items]

    with pytest.raises(ProtocolViolation):
        cls.from_wire(fields([item]))
    ok = cls.from_wire(fields([[0, 1, KEY, [1, 2], KEY]]))
    assert ok.items[0] == kv.Item(0, 1, KEY, [1, 2], KEY)  # type: ignore[attr-defined]


def _spec_wire(groups: int, views: int) -> dict:
    from hkvd.transport.layout import GroupSpec, View

    gs = [GroupSpec(i, "full", 16, 0, 16, "bfloat16", tuple(View(0, 0, 1, 4096, 4096, 4096) for _ in range(views)))
          for i in range(groups)]
    return control.EngineSpec("m", 1, 0, "t", 32, 16, 8192, "align", [], gs).to_wire()


def test_a_register_with_more_views_than_any_model_is_refused():
    # 256 groups of 4096 views made a 13.7 MiB frame that held the loop for seconds.
    assert len(control.EngineSpec.from_wire(_spec_wire(4, 4096)).groups) == 4  # 16384: at the limit
    with pytest.raises(ProtocolViolation, match="at most 16384 views in all groups"):
        control.EngineSpec.from_wire(_spec_wire(5, 4096))


def test_rank_fingerprints_are_each_ranks_own():
    import dataclasses

    from hkvd.daemon.engines.registry import fingerprint, rank_fingerprints

    spec = control.EngineSpec.from_wire({**_spec_wire(3, 5), "world_size": 4, "rank": 2})
    fps = rank_fingerprints(spec, 64, range(4))
    assert fps == tuple(fingerprint(dataclasses.replace(spec, rank=r), 64) for r in range(4))
    assert len(set(fps)) == 4 and fps[2] == fingerprint(spec, 64)


def _pieces_spec(pieces: object) -> dict:
    wire = _spec_wire(1, 2)
    wire["groups"][0]["views"][1] = [*wire["groups"][0]["views"][1], pieces]
    return wire


def test_view_pieces_travel_in_a_register_frame():
    from hkvd.daemon.engines.registry import fingerprint
    from hkvd.transport.layout import View

    pieces = [[2048, 2048], [0, 2048]]
    msg = control.Register(7, _pieces_spec(pieces))
    got = decode_body(FrameDecoder().feed(encode(msg))[0]).engine_spec()  # type: ignore[attr-defined]
    views = got.groups[0].views
    assert views[0].pieces == () and views[1] == View(0, 0, 1, 4096, 4096, 4096, ((2048, 2048), (0, 2048)))
    assert got.to_wire() == msg.spec  # a view without pieces stays 6 integers on the wire
    # Pieces say where bytes live, not what they mean: the fingerprint ignores them.
    assert fingerprint(got, 32) == fingerprint(control.EngineSpec.from_wire(_spec_wire(1, 2)), 32)


@pytest.mark.parametrize(("pieces", "match"), [
    ([], "1 to 4096"),
    ([[0, 1]] * 4097, "1 to 4096"),
    ("x", "1 to 4096"),
    ([[0, 2048], [2048]], r"\[1\]: expected \[offset"),
    ([[0, 2048], [2048, True]], r"\[1\]: expected \[offset"),
    ([[0, 2048], (2048, 1.0)], r"\[1\]: expected \[offset"),
])
def test_bad_view_pieces_are_refused(pieces: object, match: str):
    with pytest.raises(ProtocolViolation, match=r"groups\[0\]\.views\[1\]\.pieces.*" + match):
        control.EngineSpec.from_wire(_pieces_spec(pieces))


def test_view_pieces_are_bounded_in_all_groups_together():
    wire = _spec_wire(17, 1)
    for g in wire["groups"]:
        g["views"][0].append([[i, 1] for i in range(4096)])
    with pytest.raises(ProtocolViolation, match="at most 65536 view pieces"):
        control.EngineSpec.from_wire(wire)
    wire["groups"].pop()
    assert len(control.EngineSpec.from_wire(wire).groups) == 16


@pytest.mark.parametrize("fp", ["", "0123abc", "0123ABCD", "0123abcg", "a" * 33, "ALL"])
def test_lift_quarantine_takes_a_fingerprint_prefix_or_all(fp: str) -> None:
    control.LiftQuarantine(1, "all").validate()
    control.LiftQuarantine(1, "0123abcd" * 4).validate()
    with pytest.raises(ProtocolViolation, match="8 to 32 lowercase hex digits"):
        control.LiftQuarantine(1, fp).validate()


def test_pin_and_unpin_refuse_bad_values() -> None:
    with pytest.raises(ProtocolViolation, match="session id"):
        kv.Pin("a session", "", 300.0, [KEY]).validate()
    with pytest.raises(ProtocolViolation, match="session id"):
        control.Unpin(1, "x" * 129).validate()
    with pytest.raises(ProtocolViolation, match="ttl_s"):
        kv.Pin("s", "", 0.0, [KEY]).validate()
    with pytest.raises(ProtocolViolation, match="ttl_s"):
        kv.Pin("s", "", 86401.0, [KEY]).validate()
    with pytest.raises(ProtocolViolation, match="1 to"):
        kv.Pin("s", "", 10.0, []).validate()
    with pytest.raises(ProtocolViolation, match="tenant label"):
        kv.Store(1, [], b"", None, "t" * 65).validate()


def test_in_step_fields_ride_on_as_optional_trailing_fields() -> None:
    """HelloAck.pool, Register.mapped_pool, RegisterAck.in_step, Lookup.places, LookupReply.places: each
    round-trips, and left at its default it is not sent (an older peer parses the frame)."""
    places = [[[0, 0, [4096, 8192]], [1, 2, [0, 4096, 65536, 4096]]], [[0, 0, [12288, 8192]]]]
    for msg in (control.HelloAck(1, 2, 3, "s", [7, 1 << 30]), control.Register(1, {"a": 1}, "0123abcd4567"),
                control.RegisterAck(1, 2, b"f" * 16, 256, in_step=True), kv.Lookup(1, [KEY], True, places=True),
                kv.LookupReply(1, 3, 4, 30.0, 0, [], places)):
        assert decode_body(FrameDecoder().feed(encode(msg))[0]) == msg
    assert control.HelloAck(1, 2, 3, "s").to_wire() == [int(MsgType.HELLO_ACK), 1, 2, 3, "s"]
    assert control.Register(1, {}).to_wire() == [int(MsgType.REGISTER), 1, {}]
    assert kv.Lookup(1, [KEY], True).to_wire() == [int(MsgType.LOOKUP), 1, [KEY], True]
    assert kv.LookupReply(1, 3, 4, 30.0).to_wire() == [int(MsgType.LOOKUP_REPLY), 1, 3, 4, 30.0]


@pytest.mark.parametrize("msg", [
    control.HelloAck(1, 2, 3, "s", [7]), control.HelloAck(1, 2, 3, "s", [7, 0]),
    control.HelloAck(1, 2, 3, "s", [True, 4096]), control.Register(1, {}, "x" * 65),
    control.Register(1, {}, 5),  # type: ignore[arg-type]
    control.RegisterAck(1, 2, b"f" * 16, 256, in_step=1),  # type: ignore[arg-type]
    kv.Lookup(1, [KEY], True, places=1),  # type: ignore[arg-type]
    kv.LookupReply(1, 3, 4, 30.0, 0, [], [[[0, 0, []]]]), kv.LookupReply(1, 3, 4, 30.0, 0, [], [[[0, 0, [1]]]]),
    kv.LookupReply(1, 3, 4, 30.0, 0, [], [[[0, -1, [0, 1]]]]), kv.LookupReply(1, 3, 4, 30.0, 0, [], [[0, 0, [0, 1]]]),
    kv.LookupReply(1, 3, 4, 30.0, 0, [], [[[0, 0, [0, -1]]]]),
], ids=str)
def test_bad_in_step_fields_are_refused(msg: Message) -> None:
    with pytest.raises(ProtocolViolation):
        msg.validate()
    with pytest.raises(ProtocolViolation):  # as a frame too: decoded, then checked
        decode_body(FrameDecoder().feed(encode(msg))[0])


def test_peer_handshake_carries_model_keys_and_other_tp_sizes_worlds():
    from hkvd.transport.layout import GroupSpec, View

    group = GroupSpec(0, "full", 16, 0, 64, "bfloat16", (View(0, 0, 2, 64 * 4096, 4096, 4096),))
    spec = control.EngineSpec("m", 2, 0, "host/HNC", 32, 16, 8192, "none", [], [group], model_identity="w",
                              heads=[(0, 2, 4, 16)])
    auth = peer.PeerAuth(b"p" * 32, [b"f" * 16], [b"m" * 16])
    welcome = peer.PeerWelcome("agent", b"md", [b"f" * 16], 30.0, [spec.to_wire()])
    for msg in (auth, welcome):
        assert decode_body(FrameDecoder().feed(encode(msg))[0]) == msg
    assert welcome.specs() == [spec]
    old = peer.PeerAuth(b"p" * 32, [b"f" * 16])  # no model key: the field is left out
    assert old.to_wire() == [int(MsgType.PEER_AUTH), b"p" * 32, [b"f" * 16]]
    with pytest.raises(ProtocolViolation, match="a model key must be 16 bytes"):
        peer.PeerAuth(b"p" * 32, [], [b"short"]).validate()
    with pytest.raises(ProtocolViolation, match="carries no regions"):
        with_regions = control.EngineSpec("m", 2, 0, "host/HNC", 32, 16, 8192, "none",
                                          [control.Region(0, "host", 64 * 4096, 4096)], [group])
        peer.PeerWelcome("agent", b"md", [], 30.0, [with_regions.to_wire()]).validate()
    with pytest.raises(ProtocolViolation, match="EngineSpec"):
        peer.PeerWelcome("agent", b"md", [], 30.0, [{"model": 1}]).validate()
