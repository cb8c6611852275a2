"""Lookups: the hit the pool (and the tiers below it) can serve to every rank, leased when asked.

Role
    Serves ``Lookup``: plans the hit over the pool (``Cache.plan``), extends it by a partial-chunk
    tail the message offers (``_with_tail``), names the turn ends inside the chunks past the hit, and
    replies with a ``LookupReply``. With a disk or cluster tier, a lookup whose hit needs entries only
    they have awaits their reads (``daemon/tiers/promotion.py``, each tier's budget) before it replies;
    ``lookup`` returns that part as a coroutine, so the connection's later requests are not held behind it.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from hkvd.daemon.engines.connection import registered_engine, request_log
from hkvd.transport.keys import ROOT_KEY
from hkvd.transport.wire import kv

if TYPE_CHECKING:
    from hkvd.daemon.cache import Cache, HitPlan
    from hkvd.daemon.config import ConfigCell
    from hkvd.daemon.engines.connection import Conn
    from hkvd.daemon.engines.engine_traffic import EngineTraffic
    from hkvd.daemon.engines.registry import EngineState
    from hkvd.daemon.metrics import Metrics
    from hkvd.daemon.tiers.promotion import Promoter
    from hkvd.transport.turn_ends import TurnEnds


class LookupReplies:
    """Answers lookups. ``promoter`` reads what the hit needs from the lower tiers when it can."""

    def __init__(self, config: ConfigCell, index: Cache, promoter: Promoter, metrics: Metrics,
                 traffic: EngineTraffic, turn_ends: TurnEnds) -> None:
        self.config = config
        self.index = index
        self.promoter = promoter
        self.metrics = metrics
        self.traffic = traffic
        self.turn_ends = turn_ends

    def lookup(self, conn: Conn, msg: kv.Lookup) -> Coroutine[Any, Any, None] | None:
        """Answer from the pool now, or return the coroutine that first reads from the lower tiers (disk,
        cluster) what the hit needs."""
        engine = registered_engine(conn, copy=False)
        plan, missing = self._plan(engine, msg.keys)
        keys, tail = msg.keys, 0
        if msg.tails:
            plan, keys, tail = self._with_tail(engine, msg, plan)
        n = plan.hit_chunks - (tail > 0)  # the whole chunks of the hit
        if self.promoter.usable() and (n < len(msg.keys) or (not tail and self._tails_from(msg, n))):
            return self._via_tiers(conn, engine, msg)
        self._answer(conn, engine, msg, plan, missing, keys, tail)
        return None

    async def _via_tiers(self, conn: Conn, engine: EngineState, msg: kv.Lookup) -> None:
        log_extra = request_log(conn, msg.req_id)
        await self.promoter.promote(engine, msg.keys, log_extra)
        plan, missing = self._plan(engine, msg.keys)  # again: the pool may have changed meanwhile
        keys, tail = msg.keys, 0
        if msg.tails:
            plan, keys, tail = self._with_tail(engine, msg, plan)
            for _, j, key in [] if tail else self._tails_from(msg, plan.hit_chunks):  # longest first
                if await self.promoter.promote(engine, [*msg.keys[:j], key], log_extra):  # read one, try again
                    plan, keys, tail = self._with_tail(engine, msg, plan)
                    if tail:
                        break
        self._answer(conn, engine, msg, plan, missing, keys, tail)

    @staticmethod
    def _tails_from(msg: kv.Lookup, n: int) -> list[tuple[int, int, bytes]]:
        """``msg``'s tails (index, chunk, key) that may end a hit longer than ``n`` whole chunks, in the order
        sent. A tail at chunk j > n may: the whole chunks may stop at n for want of a Mamba state, which a
        partial chunk carries itself."""
        return [(i, t[0], t[1]) for i, t in enumerate(msg.tails) if t[0] >= n]

    def _with_tail(self, engine: EngineState, msg: kv.Lookup, plan: HitPlan) -> tuple[HitPlan, list[bytes], int]:
        """``plan`` (a hit of n whole chunks) extended by the first of ``msg.tails`` (at a chunk j >= n) that the
        pool serves after the chunks before it: (its plan, of j + 1 chunks; the keys it covers; 1 + the tail's
        index); ``plan`` and ``msg.keys`` with 0 when none does."""
        fps, ready = engine.rank_fingerprints, self.index.is_ready
        for i, j, key in self._tails_from(msg, plan.hit_chunks):
            if not all(ready((fp, gid, key)) for fp in fps for gid in engine.groups):
                continue  # the usual case, decided without planning the chunks before it again
            keys = [*msg.keys[:j], key]
            extended, _ = self._plan(engine, keys)
            if extended.hit_chunks == j + 1:
                return extended, keys, i + 1
        return plan, msg.keys, 0

    def _plan(self, engine: EngineState, keys: list[bytes]) -> tuple[HitPlan, dict[str, int]]:
        """The best hit the pool can serve to every rank, and the entries it lacks by kind."""
        missing: dict[str, int] = {}  # the pool only: what a retrieve can be served from
        return self.index.plan(engine, keys, engine.rank_fingerprints, missing=missing), missing

    def _answer(self, conn: Conn, engine: EngineState, msg: kv.Lookup, plan: HitPlan,
                missing: dict[str, int], keys: list[bytes], tail: int) -> None:
        """Reply with ``plan``, a hit over ``keys`` (``msg.keys``, or their first chunks and the tail ``tail``
        names), leased when asked."""
        cfg, kinds = self.config.current, engine.kinds
        lease_id = 0
        if msg.lease and plan.hit_chunks > 0:  # every rank's entries, one retrieve per rank
            lease_id = self.index.lease(plan, keys, engine.rank_fingerprints, conn.conn_id, cfg.lease_ttl_s)
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
        for kind, n in missing.items():
            self.metrics.inc("lookup_miss_entries", n, kind=kind)
        ends = self._ends(engine, msg, plan.hit_chunks) if msg.ends and not tail else []
        if ends:
            self.metrics.inc("lookup_turn_ends_named", len(ends))
        conn.send(kv.LookupReply(msg.req_id, plan.hit_chunks, lease_id, cfg.lease_ttl_s, tail, ends))

    def _ends(self, engine: EngineState, msg: kv.Lookup, n: int) -> list[list[int]]:
        """``[chunk_index, offset]`` of the turn ends engines of this layout stored inside chunks
        n .. len(msg.keys) (after the whole chunk before each), the last chunk's first: where a hit of n whole
        chunks may still end (a turn end at a chunk past n carries its own Mamba state, which the whole chunks
        may lack)."""
        out: list[list[int]] = []
        layout = engine.world_fingerprints[0]  # engines of one layout share entries, and turn ends
        for j in range(len(msg.keys), n - 1, -1):
            out.extend([j, off] for off in self.turn_ends.offsets(layout + (msg.keys[j - 1] if j else ROOT_KEY)))
            if len(out) >= kv.MAX_ENDS:
                break
        return out[:kv.MAX_ENDS]
