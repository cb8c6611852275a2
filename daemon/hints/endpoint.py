"""``POST /v1/kv/hints`` on the metrics port: routers' and agent frameworks' hints about a prefix (docs/hints.md).

Role
    The body is the hint envelope (``hkvd.transport.hint_envelope``: ``{"protocol_version": 1, "message_id",
    "actions": [{"action_id", "action_type", "action_version", "payload"}]}``). Each action's payload names its
    prefix as ``POST /v1/usable_prefix`` does (``model``, ``format``, ``token_ids`` or ``token_ids_b64``,
    ``cache_salt``, ``lora``, ``mm``: ``hkvd.daemon.routing.usable_prefix``, whose key computation is the
    shim's), beside the action's own fields (``ttl_s``, ``session``, ``destination``, ``source``, ``wait``).
    ``hkvd.daemon.hints.effects`` does what each asks.

Answer
    200 with ``{"protocol_version": 1, "message_id", "outcomes": [{"action_id", "action", "outcome", "reason",
    "chunks", ...}]}``, one outcome per action, in order, whatever each action's fate: a bad action is
    ``rejected`` with its reason, never an error for the others. A body that is not a JSON (or msgpack)
    object is a 400 ``{"error"}``, counted as one rejected hint of action ``unknown``. Actions run in order;
    a waiting prefetch holds the answer until its reads end (within the tiers' lookup budgets).

Threading
    Event loop only.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from hkvd.daemon.hints.effects import Hints, Outcome, Target
from hkvd.daemon.http import Request, Response
from hkvd.daemon.routing.usable_prefix import JSON, BadRequest, decode_body, query_from
from hkvd.transport.hint_envelope import UNKNOWN, Action, Refusal, parse_envelope
from hkvd.transport.wire.control import MAX_TENANT

if TYPE_CHECKING:
    from hkvd.daemon.routing.usable_prefix import UsablePrefix

log = logging.getLogger("hkvd.hints")

#: Payload fields an action may carry beside its prefix.
PAYLOAD = frozenset({"ttl_s", "session", "destination", "source", "wait", "priority"})


class HintsEndpoint:
    """``POST /v1/kv/hints`` over ``routing`` (formats and keys) and ``hints`` (the effects)."""

    def __init__(self, routing: UsablePrefix, hints: Hints) -> None:
        self.routing = routing
        self.hints = hints

    def post(self, req: Request) -> Awaitable[Response] | Response:
        try:
            body = decode_body(req.body, req.headers.get("content-type", JSON))
        except BadRequest as e:
            self.hints.counted(UNKNOWN, "rejected")
            fix = '{"protocol_version": 1, "actions": [{"action_type": ..., "payload": {...}}]} (docs/hints.md)'
            return Response(400, JSON, _dump({"error": f"{e}; send {fix}"}))
        return self._answer(body)

    async def _answer(self, body: dict[str, object]) -> Response:
        mid, parsed = parse_envelope(body)
        outcomes: list[Outcome] = []
        for p in parsed:
            if isinstance(p, Refusal):
                outcomes.append(self.hints.refused(p))
                continue
            outcomes.append(await self._one(p))
        for o in outcomes:
            if o.outcome == "rejected":
                log.info("hint %s %s rejected: %s", o.action, o.action_id or "(no id)", o.reason)
        return Response(200, JSON, _dump({"protocol_version": 1, "message_id": mid,
                                          "outcomes": [o.as_json() for o in outcomes]}))

    async def _one(self, a: Action) -> Outcome:
        try:
            target = await self._target(a)
        except BadRequest as e:
            return self.hints.refused(Refusal(a.action, a.action_id, f"payload: {e}"))
        if a.action == "prefetch":
            return await self.hints.prefetch(a, target)
        return self.hints.apply(a, target)

    async def _target(self, a: Action) -> Target:
        q = query_from(a.payload, self.routing.book, PAYLOAD)
        keys = await self.routing.chunk_keys(q)
        fmt = q.fmt
        groups = tuple(r.group_id for r in fmt.rules)
        world = fmt.rank_fingerprints
        return Target(shape=fmt, world=world, groups=groups, full=fmt.full_groups or groups,
                      chunk_bytes=sum(fmt.entry_bytes[g] for g in groups) * len(world), keys=keys,
                      tenant=_tenant(q.salt, q.lora))


def _tenant(salt: str | None, lora: tuple[str, str] | None) -> str:
    """The tenant label the shim gives such a request (``hkvd.shim.tenants``: the salt's digest, else the adapter)."""
    if salt:
        return "salt:" + hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()
    if lora is not None:
        name = lora[0]
        label = "lora:" + name
        if name and all("!" <= c <= "~" for c in name) and len(label) <= MAX_TENANT:
            return label
        return ""  # a label the shim shortens or hashes: counted as the unsalted share's (stats only)
    return ""


def _dump(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
