"""Lookups: the hit the pool (and the tiers below it) can serve to every rank, leased when asked.

Role
    Serves ``Lookup``: asks the cache what the lookup gets (``Cache.plan_lookup``: the whole chunks, the
    partial-chunk tail among those the message offers, the turn ends past the hit) and replies with a
    ``LookupReply``. With a disk or cluster tier, a lookup the pool alone does not serve completely (a chunk
    short, or a longer tail offered than the one it serves) first has the tiers read what the plan over the
    pool and the tiers needs (``daemon/tiers/promotion.py``, each tier's budget), then is planned over the
    pool again; ``lookup`` returns that part as a coroutine, so the connection's later requests are not held
    behind it. A leased hit whose lookup asked for places (``Lookup.places``) is answered with the pool
    extents of its entries where the engine world mapped the pool (``daemon/engines/places.py``). The cache
    decides every hit; this module only counts and replies.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from hkvd.daemon.cache import LookupPlan
from hkvd.daemon.engines.connection import registered_engine, request_log
from hkvd.daemon.tiers.contract import skipped_names
from hkvd.transport.tier_matchers import POOL, TIER_NAMES
from hkvd.transport.wire import kv

if TYPE_CHECKING:
    from hkvd.daemon.cache import Cache, Tail
    from hkvd.daemon.config import ConfigCell
    from hkvd.daemon.engines.connection import Conn
    from hkvd.daemon.engines.engine_traffic import EngineTraffic
    from hkvd.daemon.engines.places import Places
    from hkvd.daemon.engines.registry import EngineState
    from hkvd.daemon.engines.reshards import Reshards
    from hkvd.daemon.metrics import Metrics
    from hkvd.daemon.tiers.promotion import Promoter


class LookupReplies:
    """Answers lookups. ``promoter`` reads what the hit needs from the lower tiers when it can; ``places``
    names where a leased hit lies in the pool (None: --in-step-loads off, no lookup gets places)."""

    def __init__(self, config: ConfigCell, index: Cache, promoter: Promoter, metrics: Metrics,
                 traffic: EngineTraffic, places: Places | None = None, reshards: Reshards | None = None) -> None:
        self.config = config
        self.reshards = reshards  # hits in other TP sizes' entries (None: this world's format only)
        self.index = index
        self.promoter = promoter
        self.metrics = metrics
        self.traffic = traffic
        self.places = places

    def lookup(self, conn: Conn, msg: kv.Lookup) -> Coroutine[Any, Any, None] | None:
        """Answer from the pool now, or return the coroutine that first reads from the lower tiers (disk,
        cluster) what the hit needs."""
        engine = registered_engine(conn, copy=False)
        tails = [(t[0], t[1]) for t in msg.tails]
        if msg.skip_tiers:
            for bit, name in TIER_NAMES.items():
                if msg.skip_tiers & bit:
                    self.metrics.inc("lookup_tiers_left_out", tier=name)
        if msg.skip_tiers & POOL:  # every hit is served from the pool: a lookup that leaves it out loads nothing
            self._answer(conn, engine, msg, LookupPlan(0, {}, [], engine.rank_fingerprints))
            return None
        plan = self._plan(engine, msg, tails, seen=True)  # the admission counts each request's keys once
        skip = skipped_names(msg.skip_tiers)
        if not plan.complete and self.promoter.usable(skip):
            return self._via_tiers(conn, engine, msg, tails, skip)
        self._answer(conn, engine, msg, plan)
        return None

    async def _via_tiers(self, conn: Conn, engine: EngineState, msg: kv.Lookup, tails: list[Tail],
                         skip: frozenset[str]) -> None:
        await self.promoter.promote(engine, msg.keys, request_log(conn, msg.req_id), tails, skip)
        self._answer(conn, engine, msg, self._plan(engine, msg, tails))  # again: the pool may have changed meanwhile

    def _plan(self, engine: EngineState, msg: kv.Lookup, tails: list[Tail], seen: bool = False) -> LookupPlan:
        """The best hit the pool can serve to every rank, with the entries it lacks by kind."""
        layout = engine.world_fingerprints[0]  # engines of one layout share entries, and turn ends
        plan = self.index.plan_lookup(engine, msg.keys, engine.rank_fingerprints, tails=tails,
                                      ends_of=layout if msg.ends else None, count_missing=True, seen=seen)
        if self.reshards is not None and not plan.complete:  # other TP sizes' entries, re-sharded on read
            plan = self.reshards.plan(engine, msg.keys, tails, plan)
        return plan

    def _answer(self, conn: Conn, engine: EngineState, msg: kv.Lookup, plan: LookupPlan) -> None:
        """Reply with ``plan``, leased when asked."""
        cfg, kinds = self.config.current, engine.kinds
        lease_id = 0
        if msg.lease and plan.hit_chunks > 0:  # every rank's entries, one retrieve per rank
            lease_id = self.index.lease(plan, conn.conn_id, cfg.lease_ttl_s)
        self.metrics.inc("lookups")
        self.metrics.inc("lookup_hit_chunks", plan.hit_chunks)
        self.metrics.inc("lookup_miss_chunks", max(0, len(msg.keys) - plan.hit_chunks))
        self.traffic.lookup(engine.spec.model, engine.spec.rank, plan.hit_chunks * engine.chunk_size,
                            max(0, len(msg.keys) - plan.hit_chunks) * engine.chunk_size)
        hit_by_kind: dict[str, int] = {}
        for gid, chunks in plan.needed.items():
            hit_by_kind[kinds[gid]] = hit_by_kind.get(kinds[gid], 0) + len(chunks)
        for kind, n in hit_by_kind.items():
            self.metrics.inc("lookup_hit_entries", n, kind=kind)
        for kind, n in plan.missing.items():
            self.metrics.inc("lookup_miss_entries", n, kind=kind)
        if plan.ends:
            self.metrics.inc("lookup_turn_ends_named", len(plan.ends))
        # In-step loads read one rank's entries whole: never offered for a re-sharded hit (plan.readers).
        places = (self.places.of(plan, engine)
                  if msg.places and lease_id and self.places is not None and not plan.readers else [])
        if places:
            self.metrics.inc("lookup_places")
        conn.send(kv.LookupReply(msg.req_id, plan.hit_chunks, lease_id, cfg.lease_ttl_s, plan.tail, plan.ends,
                                 places))
