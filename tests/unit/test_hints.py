"""The KV hint vocabulary (docs/hints.md): the envelope's parsing (hkvd.transport.hint_envelope), a request's
hints in its kv_transfer_params (hkvd.shim.hints: never raises, one warning naming the field, rejected hints
counted), the engine path's wire message (kv.Hints: every field bounded, decode checked), and demotion in the
eviction orders."""

from __future__ import annotations

import math

import msgpack
import pytest

from hkvd.shim import hints as shim_hints
from hkvd.transport import hint_envelope as hints
from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.wire import kv, message_from_wire

KEY = b"k" * 16


def env(*actions: object, **top: object) -> dict[str, object]:
    return {"protocol_version": 1, "message_id": "m", "actions": list(actions), **top}


@pytest.mark.parametrize("raw, name", [
    ("pin", "pin"), ("Pin", "pin"), ("kv.pin", "pin"), ("kv.retain@1.0", "retain"), ("kv.fetch", "prefetch"),
    ("PREFETCH", "prefetch"), ("share", "share"), ("kv.demote", "demote"),
    ("evict", None), ("", None), (7, None), (None, None), ("x" * 100, None),
])
def test_action_names(raw: object, name: str | None) -> None:
    assert hints.action_name(raw) == name


def test_the_envelope_parses_good_actions_and_refuses_each_bad_one_with_its_reason() -> None:
    mid, out = hints.parse_envelope(env(
        {"action_id": "a", "action_type": "pin", "action_version": "1.0", "payload": {"ttl_s": 30, "session": "s"}},
        {"action_id": 2, "action_type": "evict"},
        {"action_type": "pin", "payload": {"ttl_s": 0}},
        {"action_type": "pin", "payload": {"ttl_s": math.inf}},
        {"action_type": "pin", "payload": {"ttl_s": True}},
        {"action_type": "pin", "payload": {}},
        {"action_type": "retain", "payload": {"session": "has space"}},
        {"action_type": "demote", "action_version": "2"},
        {"action_type": "share", "payload": [1]},
        "pin",
        {"action_type": "kv.fetch@1.0"},
    ))
    assert mid == "m"
    good = out[0]
    assert isinstance(good, hints.Action) and (good.action, good.action_id, good.ttl_s, good.session) == \
        ("pin", "a", 30.0, "s")
    refused = out[1:10]
    assert all(isinstance(r, hints.Refusal) for r in refused)
    reasons = [r.reason for r in refused if isinstance(r, hints.Refusal)]
    assert [r.action for r in refused] == ["unknown", "pin", "pin", "pin", "pin", "retain", "demote", "share",
                                           "unknown"]
    assert out[1].action_id == "2" and "use one of share, prefetch, demote, pin, retain" in reasons[0]
    assert all("ttl_s" in r for r in reasons[1:4]) and "needs payload.ttl_s" in reasons[4]
    assert "session" in reasons[5] and "action_version" in reasons[6] and "payload must be an object" in reasons[7]
    assert "must be an object" in reasons[8]
    last = out[10]
    assert isinstance(last, hints.Action) and last.action == "prefetch" and last.ttl_s is None


@pytest.mark.parametrize("raw, words", [
    ([1, 2], "must be an object"), ({"protocol_version": 2, "actions": []}, "protocol_version"),
    ({"actions": "pin"}, "must be a list"), ({"protocol_version": True, "actions": []}, "protocol_version"),
])
def test_an_envelope_that_cannot_be_read_is_one_refusal(raw: object, words: str) -> None:
    _, out = hints.parse_envelope(raw)
    assert len(out) == 1 and isinstance(out[0], hints.Refusal) and words in out[0].reason


def test_actions_past_the_bound_are_refused_one_by_one() -> None:
    _, out = hints.parse_envelope(env(*[{"action_type": "retain"}] * (hints.MAX_ACTIONS + 3)))
    assert len(out) == hints.MAX_ACTIONS + 3
    assert all(isinstance(a, hints.Action) for a in out[:hints.MAX_ACTIONS])
    assert all(isinstance(r, hints.Refusal) and "more than" in r.reason and r.action == "retain"
               for r in out[hints.MAX_ACTIONS:])


def test_a_requests_hints_under_either_key() -> None:
    for key in ("kv_hints", "kv_hint"):
        got, problem = shim_hints.parse({key: env({"action_type": "kv.pin", "payload": {"ttl_s": 9, "session": "c"}},
                                                  {"action_type": "share"})})
        assert problem == "" and got is not None
        assert got.asks == [shim_hints.HintAsk("pin", 9.0, "c"), shim_hints.HintAsk("share")] and not got.counted


def test_a_request_without_hints_or_a_pin_has_none() -> None:
    for params in (None, {}, {"do_remote_prefill": True}, "text", {"hkvd": {}}):
        assert shim_hints.parse(params) == (None, "")


def test_the_session_pin_counts_as_a_pin() -> None:
    got, problem = shim_hints.parse({"hkvd": {"pin_s": 5, "session": "s"}}, "accepted")
    assert problem == "" and got is not None and got.counted == {"pin/accepted": 1} and not got.asks
    got, _ = shim_hints.parse({"hkvd": {"pin_s": -1}}, "rejected")
    assert got is not None and got.counted == {"pin/rejected": 1}


def test_bad_hints_on_a_request_are_rejected_counted_and_warned_once() -> None:
    got, problem = shim_hints.parse({"kv_hints": env(
        {"action_type": "evict"}, {"action_type": "pin", "payload": {"ttl_s": -3}}, {"action_type": "prefetch"},
        {"action_type": "share", "payload": {"destination": "worker-b"}},
        {"action_type": "retain", "payload": {"ttl_s": 1e30}})}, "accepted")
    assert got is not None
    assert got.counted == {"pin/accepted": 1, "unknown/rejected": 1, "pin/rejected": 1, "prefetch/rejected": 1,
                           "share/rejected": 1}
    assert got.asks == [shim_hints.HintAsk("retain", kv.MAX_HINT_TTL_S, "")]  # the daemon clips it, and says so
    assert problem.count("\n") == 0 and "kv_transfer_params['kv_hints'] actions[0]" in problem
    assert "evict" in problem and "(and 3 more)" in problem
    got, problem = shim_hints.parse({"kv_hint": "pin"})
    assert got is not None and got.counted == {"unknown/rejected": 1} and "must be an object" in problem


def test_unreadable_asks_are_counted_as_rejected() -> None:
    got, _ = shim_hints.parse({"kv_hints": env({"action_type": "demote"}, {"action_type": "demote"})})
    assert got is not None
    got.reject_asks()
    assert got.asks == [] and got.counted == {"demote/rejected": 2}


def test_the_wire_message_round_trips_and_checks_every_field() -> None:
    msg = kv.Hints("salt:0123456789abcdef", [KEY, KEY], ["pin", "demote"], [30.0, 0.0], ["s-1", ""],
                   {"pin/accepted": 1, "prefetch/rejected": 2})
    msg.validate()
    assert message_from_wire(msgpack.unpackb(msgpack.packb(msg.to_wire()), raw=False)) == msg
    only_counts = kv.Hints("", [], [], [], [], {"unknown/rejected": 1})
    only_counts.validate()
    assert tuple(a for a in hints.ACTIONS if a != "prefetch") == kv.HINT_ACTIONS
    assert kv.HINT_OUTCOMES == hints.OUTCOMES and (*hints.ACTIONS, hints.UNKNOWN) == kv.HINT_COUNTED_ACTIONS
    for bad in (kv.Hints("", [], ["pin"], [1.0], [""]),  # actions without keys
                kv.Hints("", [b"short"], ["pin"], [1.0], [""]),
                kv.Hints("", [KEY], ["prefetch"], [0.0], [""]),
                kv.Hints("", [KEY], ["pin"], [1.0], []),
                kv.Hints("", [KEY], ["pin"], [math.nan], [""]),
                kv.Hints("", [KEY], ["pin"], [-1.0], [""]),
                kv.Hints("", [KEY], ["pin"], [1.0], ["bad session"]),
                kv.Hints("", [KEY], ["pin"] * 65, [1.0] * 65, [""] * 65),
                kv.Hints("", [], [], [], [], {"pin/won": 1}),
                kv.Hints("", [], [], [], [], {"pin/accepted": 0}),
                kv.Hints("has space", [], [], [], [])):
        with pytest.raises(ProtocolViolation):
            bad.validate()
    with pytest.raises(ProtocolViolation):
        message_from_wire([int(kv.Hints.TYPE), "", [KEY], ["pin"], ["1"], [""]])


@pytest.mark.parametrize("name", ["lru", "hybrid", "cost"])
def test_a_demoted_entry_is_evicted_first_until_a_hit_moves_it_back(name: str) -> None:
    from hkvd.daemon.cache.eviction import make_policy

    policy = make_policy(name)
    for k in "abcd":
        policy.insert(k)
    assert policy.demote("c") and not policy.demote("zz")
    assert next(iter(policy.candidates())) == "c"
    policy.touch("c")  # a hit
    assert next(iter(policy.candidates())) == "a"


def test_a_tenants_order_demotes_in_its_own_order() -> None:
    from hkvd.daemon.cache.eviction import make_policy
    from hkvd.daemon.cache.quotas import TenantOrder, Tenants

    order = TenantOrder(lambda: make_policy("lru"), lambda k: "t" if str(k).startswith("t") else "", Tenants(1 << 20))
    for k in ("a", "b", "t1", "t2"):
        order.insert(k)
    assert order.demote("t2") and not order.demote("nope")
    assert list(order.candidates_for("t", 1)).index("t2") < list(order.candidates_for("t", 1)).index("t1")


def test_the_session_pins_outcome() -> None:
    assert shim_hints.pin_outcome(True, {"hkvd": {"pin_s": 5, "session": "s"}}) == "accepted"
    assert shim_hints.pin_outcome(False, {"hkvd": {"pin_s": -5, "session": "s"}}) == "rejected"
    assert shim_hints.pin_outcome(False, {"hkvd": {"session": "s"}}) == "rejected"
    for params in (None, {}, {"hkvd": {}}, {"hkvd": {"store_decode": False}}, {"hkvd": "x"}, {"kv_hints": {}}):
        assert shim_hints.pin_outcome(False, params) == "", params


def test_shutdown_waits_for_deferred_prefetches_then_cancels_the_rest() -> None:
    import asyncio
    from typing import Any, cast

    from hkvd.daemon.hints.effects import Hints

    async def main() -> tuple[int, bool, bool, int]:
        h = Hints(cast(Any, None), cast(Any, None))
        stuck = asyncio.Event()
        quick = asyncio.get_running_loop().create_task(asyncio.sleep(0.01))
        slow = asyncio.get_running_loop().create_task(stuck.wait())
        for t in (quick, slow):
            h._deferred.add(t)  # as prefetch(wait=False) keeps them
        cancelled = await h.drain(0.2)
        return cancelled, quick.done() and not quick.cancelled(), slow.cancelled(), await Hints.drain(h, 0.0)

    cancelled, quick_ran, slow_cancelled, again = asyncio.run(main())
    assert (cancelled, quick_ran, slow_cancelled) == (1, True, True)
    assert again == 0  # a second drain finds nothing left to cancel
