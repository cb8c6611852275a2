"""The KV hint vocabulary both sides speak: actions, outcomes, bounds, and the envelope's parsing.

Role
    Routers and agent frameworks send advisory hints about a prefix's KV: ``share``, ``prefetch``,
    ``demote``, ``pin``, ``retain`` (the vocabulary of vLLM's RFCs #51428/#57103, SGLang #27574 and
    Dynamo's ``KvHint``). They arrive in the envelope vLLM's RFC #53421 and Dynamo's ``KvHint`` share:
    ``{"protocol_version", "message_id", "actions": [{"action_id", "action_type", "action_version",
    "payload"}]}``, over the metrics port (``hkvd.daemon.hints``) or in a request's ``kv_transfer_params``
    (``hkvd.shim.hints``). Each action is answered with one outcome: ``accepted``, ``clipped`` (done within
    a bound: a shorter TTL, fewer chunks), ``deferred`` (queued, not done when answered) or ``rejected``
    (nothing done), with a reason in words (docs/hints.md).

    This module checks what both sides check the same way: the envelope's shape, the action's name
    (``pin``, ``kv.pin``, ``Pin``, ``kv.pin@1.0``; Dynamo's ``kv.fetch`` is ``prefetch``), its version and
    the common payload fields (``ttl_s``, ``session``). What a hint names as its prefix is each side's.

Contracts
    ``parse_envelope`` never raises: an envelope that cannot be read at all gives one ``Refusal`` (action
    ``unknown``); each bad action gives a ``Refusal`` naming the field and the fix; the good ones come back
    as ``Action`` records, in order. At most ``MAX_ACTIONS`` actions per envelope (the rest are refused).

Threading
    Pure functions; no state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.wire.control import MAX_SESSION, check_session
from hkvd.transport.wire.kv import MAX_PIN_S

ACTIONS = ("share", "prefetch", "demote", "pin", "retain")
UNKNOWN = "unknown"  # the action label of a hint whose action could not be read
OUTCOMES = ("accepted", "clipped", "deferred", "rejected")
ALIASES = {"fetch": "prefetch"}  # Dynamo's kv.fetch@1.0
VERSIONS = ("1", "1.0")  # action_version: absent, or one of these
PROTOCOL_VERSIONS = (1,)
MAX_ACTIONS = 64
MAX_ID = 128  # characters of a message_id or action_id
MAX_TTL_S = MAX_PIN_S  # a pin's TTL bound (a day); longer asks are clipped
COMMON = ("ttl_s", "session")


@dataclass(frozen=True, slots=True)
class Action:
    """One readable action: its normalized name, its id (``""`` when not given) and its payload."""

    action: str
    action_id: str
    payload: Mapping[str, object] = field(default_factory=dict)
    ttl_s: float | None = None  # as asked (checked: a finite number > 0); clipping is the applier's
    session: str | None = None


@dataclass(frozen=True, slots=True)
class Refusal:
    """A hint rejected before it was tried: its action (``unknown`` when unreadable), id and reason."""

    action: str
    action_id: str
    reason: str


def action_name(raw: object) -> str | None:
    """``pin``/``Pin``/``kv.pin``/``kv.pin@1.0`` -> ``pin``; Dynamo's ``kv.fetch`` -> ``prefetch``; None if unknown."""
    if not isinstance(raw, str) or len(raw) > 64:
        return None
    name = raw.split("@", 1)[0].strip().lower()
    name = name.removeprefix("kv.").removeprefix("kv_")
    name = ALIASES.get(name, name)
    return name if name in ACTIONS else None


def _id(raw: object) -> str:
    if isinstance(raw, str):
        return raw[:MAX_ID]
    if isinstance(raw, int) and not isinstance(raw, bool):
        return str(raw)[:MAX_ID]
    return ""


def check_ttl(raw: object) -> float | str:
    """The TTL asked for, or the reason it is refused (not a number, not finite, 0 or less)."""
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw) or raw <= 0:
        return (f"payload.ttl_s={repr(raw)[:40]}: give a number of seconds more than 0 (at most {MAX_TTL_S:.0f}; "
                "longer is clipped)")
    return float(raw)


def parse_action(raw: object) -> Action | Refusal:
    """One entry of ``actions``: an ``Action``, or a ``Refusal`` naming the field and the fix."""
    if not isinstance(raw, Mapping):
        return Refusal(UNKNOWN, "", f"an action must be an object {{\"action_type\", \"payload\", ...}}, got a "
                                    f"{type(raw).__name__}")
    aid = _id(raw.get("action_id"))
    kind = raw.get("action_type", raw.get("action"))
    name = action_name(kind)
    if name is None:
        return Refusal(UNKNOWN, aid, f"action_type={repr(kind)[:60]} is not a hint hkvd knows; use one of "
                                     f"{', '.join(ACTIONS)} (or kv.<action>)")
    version = raw.get("action_version")
    if version is None and isinstance(kind, str) and "@" in kind:
        version = kind.split("@", 1)[1]
    if version is not None and str(version) not in VERSIONS:
        return Refusal(name, aid, f"action_version={repr(version)[:20]} is not supported; send 1.0 or leave it out")
    payload = raw.get("payload", {})
    if payload is None:
        payload = {}
    if not isinstance(payload, Mapping):
        return Refusal(name, aid, f"payload must be an object, got a {type(payload).__name__}")
    ttl: float | None = None
    if "ttl_s" in payload:
        got = check_ttl(payload["ttl_s"])
        if isinstance(got, str):
            return Refusal(name, aid, got)
        ttl = got
    elif name == "pin":
        return Refusal(name, aid, f"a pin needs payload.ttl_s: seconds to hold the prefix, at most {MAX_TTL_S:.0f}")
    session = payload.get("session")
    if session is not None:
        if not isinstance(session, str):
            return Refusal(name, aid, f"payload.session must be a string of 1 to {MAX_SESSION} printable ASCII "
                                      "characters without spaces")
        try:
            check_session(session, "payload.session")
        except ProtocolViolation as e:
            return Refusal(name, aid, e.message)
    return Action(name, aid, payload, ttl, session)


def parse_envelope(raw: object) -> tuple[str, list[Action | Refusal]]:
    """(the envelope's message_id, each action parsed in order); never raises (module docstring)."""
    if not isinstance(raw, Mapping):
        return "", [Refusal(UNKNOWN, "", f"the hints must be an object {{\"protocol_version\": 1, \"actions\": "
                                         f"[...]}}, got a {type(raw).__name__}")]
    mid = _id(raw.get("message_id"))
    version = raw.get("protocol_version", 1)
    if version not in PROTOCOL_VERSIONS or isinstance(version, bool):
        return mid, [Refusal(UNKNOWN, "", f"protocol_version={repr(version)[:20]} is not supported; send 1")]
    actions = raw.get("actions")
    if not isinstance(actions, list):
        return mid, [Refusal(UNKNOWN, "", "\"actions\" must be a list of {\"action_type\", \"payload\"} objects")]
    out: list[Action | Refusal] = [parse_action(a) for a in actions[:MAX_ACTIONS]]
    out += [Refusal(action_name(a.get("action_type")) or UNKNOWN if isinstance(a, Mapping) else UNKNOWN,
                    _id(a.get("action_id")) if isinstance(a, Mapping) else "",
                    f"more than {MAX_ACTIONS} actions in one envelope; send the rest in another")
            for a in actions[MAX_ACTIONS:]]
    return mid, out
