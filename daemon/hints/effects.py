"""What each KV hint does to the cache, for a prefix already resolved to its chunk keys (docs/hints.md).

Role
    Both paths end here: a router's ``POST /v1/kv/hints`` (``hkvd.daemon.hints.endpoint``, the prefix named
    by token ids) and an engine's ``kv.Hints`` (a request's ``kv_transfer_params``, the prefix being that
    request's chunk keys). ``Target`` is the prefix: its engine world, groups and chunk keys. ``Hints``
    applies one parsed action (``hkvd.transport.hint_envelope.Action``) and answers an ``Outcome``; every outcome is
    counted as ``hints{action, outcome}`` (``/metrics``: ``hkvd_hints_total``).

What each action is here
    - ``pin``: a session pin (``daemon/cache/pins.py``) of the prefix's chunks for ``ttl_s``, as
      ``session`` (or ``hint-<hex>``, named by the prefix's last chunk key). A TTL over a day is clipped to
      a day; a prefix whose entries would take more than the pin budget (``--pin-max-fraction``) is pinned
      as far as the budget goes (``clipped``). Refused past 4096 pinned sessions (``rejected``).
    - ``retain``: the prefix's pool entries move to the back of the eviction order, as a hit moves them, and
      the admission counts its chunks once more. No guarantee and no lease: later traffic may still evict
      them (a ``ttl_s`` is not kept: ``clipped``, the reason says to send ``pin``).
    - ``demote``: ``session``'s pins end (when named), then the prefix's pool entries go to the front of
      the eviction order: the first evicted, until a hit moves them back. Their copies in the disk tier stay.
      Entries still held (another session's pin, a lease) stay where they are (``clipped``).
    - ``share``: the prefix is expected by many requests: the admission (``--admission tinylfu``) counts
      its chunks twice, so their stores are admitted over one-shot chunks, and its pool entries move to
      the back of the eviction order. A ``destination`` (another worker) is not supported: ``rejected``.
    - ``prefetch``: the chunks a lookup of the prefix would miss in the pool and find in the disk or
      cluster tier are read into the pool now (``daemon/tiers/promotion.py``, the lookups' own path and
      budgets), so the request's lookup finds them in memory. ``wait: false``: the reads run after the
      answer (``deferred``). ``source`` ``disk`` or ``cluster`` reads as ``any`` does (each chunk from the first
      tier that holds it, as for a lookup); a peer as the source is not supported (``rejected``).

Threading
    Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from hkvd.daemon.cache import Cache, EntryKey
from hkvd.daemon.metrics import Metrics
from hkvd.transport.hint_envelope import MAX_TTL_S, Action, Refusal

if TYPE_CHECKING:
    from hkvd.daemon.cache import Shape
    from hkvd.daemon.engines.connection import RequestLog
    from hkvd.daemon.engines.registry import EngineState
    from hkvd.daemon.tiers.promotion import Promoter

log = logging.getLogger("hkvd.hints")

COUNTER = "hints"  # Metrics.inc(COUNTER, action=..., outcome=...): hkvd_hints_total
SOURCES = ("any", "disk", "cluster", "peer")
PREFETCH_OWNER = -2  # promotion's log line names no connection for a router's prefetch


@dataclass(frozen=True, slots=True)
class Target:
    """A prefix as the cache keys it: every rank of ``world``, each of ``groups``, per chunk key of ``keys``."""

    shape: Shape  # the layout (an engine's registration, or its format as routers see it)
    world: tuple[bytes, ...]
    groups: tuple[int, ...]
    full: tuple[int, ...]  # the groups whose entries make a chunk present (full attention; else every group)
    chunk_bytes: int  # bytes of one chunk's entries, every group and rank
    keys: list[bytes]
    tenant: str = ""

    def entries(self, keys: list[bytes] | None = None) -> list[EntryKey]:
        return [(fp, g, k) for k in (self.keys if keys is None else keys) for g in self.groups for fp in self.world]


def hint_target(engine: EngineState, keys: list[bytes], tenant: str = "") -> Target:
    """The prefix ``keys`` as ``engine``'s world keys it (an engine's ``kv.Hints``)."""
    world = engine.world_fingerprints
    groups = tuple(engine.groups)
    full = tuple(g for g in groups if engine.kinds.get(g) == "full") or groups
    return Target(shape=engine, world=world, groups=groups, full=full,
                  chunk_bytes=sum(engine.entry_bytes[g] for g in groups) * len(world), keys=keys, tenant=tenant)


@dataclass(slots=True)
class Outcome:
    """One action's answer (``as_json``: an entry of the HTTP answer's ``outcomes``)."""

    action: str
    action_id: str
    outcome: str  # accepted, clipped, deferred, rejected
    reason: str
    chunks: int = 0  # chunks the action took effect on
    extra: dict[str, object] = field(default_factory=dict)

    def as_json(self) -> dict[str, object]:
        return {"action_id": self.action_id, "action": self.action, "outcome": self.outcome, "reason": self.reason,
                "chunks": self.chunks, **self.extra}


class Hints:
    """The actions over ``cache``; ``promoter`` and ``engines`` (the live engines) serve ``prefetch``."""

    def __init__(self, cache: Cache, metrics: Metrics, promoter: Promoter | None = None,
                 engines: Callable[[], list[EngineState]] | None = None) -> None:
        self.cache = cache
        self.metrics = metrics
        self.promoter = promoter
        self.engines: Callable[[], list[EngineState]] = engines if engines is not None else list
        self._deferred: set[asyncio.Task[Outcome]] = set()

    # ---- counting --------------------------------------------------------------------------------
    def count(self, out: Outcome) -> Outcome:
        self.metrics.inc(COUNTER, action=out.action, outcome=out.outcome)
        return out

    def refused(self, r: Refusal) -> Outcome:
        return self.count(Outcome(r.action, r.action_id, "rejected", r.reason))

    def counted(self, action: str, outcome: str, n: int = 1) -> None:
        """Hints decided elsewhere (an engine's shim: refused, or sent as ``kv.Pin``), counted here."""
        self.metrics.inc(COUNTER, n, action=action, outcome=outcome)

    # ---- the actions ------------------------------------------------------------------------------
    def apply(self, a: Action, t: Target) -> Outcome:
        """``pin``, ``retain``, ``demote`` or ``share`` at once (``prefetch``: ``prefetch``)."""
        fn = {"pin": self._pin, "retain": self._retain, "demote": self._demote, "share": self._share}.get(a.action)
        if fn is None:
            return self.count(Outcome(a.action, a.action_id, "rejected", f"{a.action} is not served on this path"))
        return self.count(fn(a, t))

    def _pin(self, a: Action, t: Target) -> Outcome:
        assert a.ttl_s is not None  # parse_action requires it for a pin
        clipped: list[str] = []
        ttl = a.ttl_s
        if ttl > MAX_TTL_S:
            ttl = MAX_TTL_S
            clipped.append(f"ttl_s {a.ttl_s:g} is over the bound: held {MAX_TTL_S:.0f} s")
        if not t.keys:
            return Outcome("pin", a.action_id, "rejected", "the prefix has no whole chunk to pin")
        budget = self.cache.sessions.statistics().budget_bytes
        keys = t.keys
        if t.chunk_bytes * len(keys) > budget:
            fit = budget // max(t.chunk_bytes, 1)
            if fit == 0:
                return Outcome("pin", a.action_id, "rejected", f"one chunk's entries ({t.chunk_bytes} bytes) are over "
                               f"the pin budget ({budget} bytes, --pin-max-fraction)")
            keys = keys[:fit]
            clipped.append(f"{len(t.keys)} chunks are over the pin budget ({budget} bytes, --pin-max-fraction): "
                           f"pinned the first {fit}")
        session = a.session or f"hint-{keys[-1][:8].hex()}"
        if not self.cache.sessions.pin(t.world, session, t.tenant, list(keys), ttl):
            return Outcome("pin", a.action_id, "rejected", "too many sessions are pinned (4096); end some (POST "
                           "/unpin?session=ID) or ask for shorter pins")
        extra: dict[str, object] = {"session": session, "ttl_s": ttl}
        if clipped:
            return Outcome("pin", a.action_id, "clipped", "; ".join(clipped), len(keys), extra)
        return Outcome("pin", a.action_id, "accepted", f"pinned {len(keys)} chunks for {ttl:g} s as session "
                       f"{session}", len(keys), extra)

    def _in_pool(self, t: Target) -> int:
        """Chunks of the prefix with every full-attention entry (of every rank) READY in the pool."""
        ready = self.cache.is_ready
        return sum(all(ready((fp, g, k)) for g in t.full for fp in t.world) for k in t.keys)

    def _retain(self, a: Action, t: Target) -> Outcome:
        moved = self.cache.retain(t.entries())
        self.cache.count_seen(t.keys)
        if not moved:
            return Outcome("retain", a.action_id, "rejected", "no entry of the prefix is in the pool (send prefetch "
                           "first to read it from the disk or cluster tier)")
        chunks = self._in_pool(t)
        if a.ttl_s is not None:
            return Outcome("retain", a.action_id, "clipped", "moved to the back of the eviction order; retain holds "
                           "no lease, so ttl_s is not kept (send pin for a bounded hold)", chunks)
        return Outcome("retain", a.action_id, "accepted", f"{moved} entries moved to the back of the eviction order",
                       chunks)

    def _demote(self, a: Action, t: Target) -> Outcome:
        ended = self.cache.sessions.unpin(a.session) if a.session else 0
        moved = self.cache.demote(t.entries())
        held = sum(self.cache.sessions.holds(k) for k in t.entries() if self.cache.get(k) is not None)
        extra: dict[str, object] = {"unpinned": ended} if a.session else {}
        if not moved and not ended:
            if held:
                return Outcome("demote", a.action_id, "rejected", f"{held} entries of the prefix are held by session "
                               "pins; name their session in payload.session to end them", 0, extra)
            return Outcome("demote", a.action_id, "rejected", "no entry of the prefix is in the pool", 0, extra)
        what = f"{moved} entries are first in the eviction order" + (f"; {ended} pins of {a.session} ended"
                                                                      if a.session else "")
        if held:
            return Outcome("demote", a.action_id, "clipped", f"{what}; {held} entries stay held by other sessions' "
                           "pins or leases", moved, extra)
        return Outcome("demote", a.action_id, "accepted", what, moved, extra)

    def _share(self, a: Action, t: Target) -> Outcome:
        dest = a.payload.get("destination")
        if dest is not None:
            return Outcome("share", a.action_id, "rejected", "share to another worker is not supported: each node's "
                           "hkvd reads from the shared disk or cluster tier or pulls from its peers on its own "
                           "(docs/peers.md); leave destination out to mark the prefix as shared here")
        moved = self.cache.retain(t.entries())
        counted = self.cache.count_seen(t.keys, 2)
        adm = ("its chunks count as asked for twice in the admission" if counted
               else "the admission is off (--admission none), so every store is admitted anyway")
        return Outcome("share", a.action_id, "accepted", f"{adm}; {moved} pool entries moved to the back of the "
                       "eviction order", self._in_pool(t))

    # ---- prefetch ---------------------------------------------------------------------------------
    def engine_for(self, world: tuple[bytes, ...]) -> EngineState | None:
        """A live engine of ``world`` (promotion reads by its registration's groups and entry sizes)."""
        return next((e for e in self.engines() if e.world_fingerprints == world), None)

    def check_prefetch(self, a: Action, t: Target) -> Outcome | None:
        """The outcome of a prefetch that needs no read (bad source, nothing to read), or None."""
        source = a.payload.get("source", "any")
        if source not in SOURCES:
            return self.count(Outcome("prefetch", a.action_id, "rejected", f"payload.source={repr(source)[:40]}: "
                                      f"give one of {', '.join(SOURCES)}"))
        if source == "peer":
            return self.count(Outcome("prefetch", a.action_id, "rejected", "prefetch from a peer is not supported: "
                                      "peers serve pulls of a request's own prefix (docs/peers.md); prefetch reads "
                                      "from the disk and cluster tiers"))
        if not t.keys:
            return self.count(Outcome("prefetch", a.action_id, "rejected", "the prefix has no whole chunk"))
        have = self._hit(t)
        if have == len(t.keys):
            return self.count(Outcome("prefetch", a.action_id, "accepted", "the prefix is in the pool already", have))
        if self.promoter is None or not self.promoter.tiers:
            return self.count(Outcome("prefetch", a.action_id, "rejected", f"the pool holds {have} of "
                                      f"{len(t.keys)} chunks and this daemon has no disk or cluster tier to read "
                                      "the rest from (--l2-path, --cluster)", have))
        if not self.promoter.usable():
            return self.count(Outcome("prefetch", a.action_id, "rejected", f"the prefix past chunk {have} is in no "
                                      "tier: the pool lacks it and the disk and cluster tiers hold nothing now",
                                      have))
        if self.engine_for(t.world) is None:
            return self.count(Outcome("prefetch", a.action_id, "rejected", "no engine of this format is registered "
                                      "now; reads into the pool follow a live engine's layout", have))
        return None

    def _hit(self, t: Target) -> int:
        return self.cache.plan_lookup(t.shape, t.keys, t.world).hit_chunks

    async def prefetch(self, a: Action, t: Target) -> Outcome:
        """Read into the pool what a lookup of ``t`` would miss there and the tiers hold (``check_prefetch``
        first). ``payload.wait`` false: started, answered ``deferred``."""
        early = self.check_prefetch(a, t)
        if early is not None:
            return early
        if a.payload.get("wait", True) is False:
            task = asyncio.get_running_loop().create_task(self._read(a, t))
            self._deferred.add(task)
            task.add_done_callback(self._deferred.discard)
            return self.count(Outcome("prefetch", a.action_id, "deferred", "the reads run after this answer; "
                                      "GET /metrics counts their end (hkvd_l2_hits_total, hkvd_cluster_hits_total)",
                                      self._hit(t)))
        return self.count(await self._read(a, t))

    async def drain(self, timeout_s: float) -> int:
        """At shutdown: wait up to ``timeout_s`` for the deferred prefetches (each bounded by its tiers' read
        budgets), then cancel what is left; the number cancelled."""
        if not self._deferred:
            return 0
        _, left = await asyncio.wait(set(self._deferred), timeout=max(timeout_s, 0.0))
        for task in left:
            task.cancel()
        if left:
            await asyncio.gather(*left, return_exceptions=True)
            log.warning("%d deferred prefetches cancelled at shutdown; their chunks stay where they were", len(left))
        return len(left)

    async def _read(self, a: Action, t: Target) -> Outcome:
        before = self._hit(t)
        engine = self.engine_for(t.world)
        if engine is None or self.promoter is None:  # gone since the check
            return Outcome("prefetch", a.action_id, "rejected", "the format's engine left before the reads", before)
        log_extra = cast("RequestLog", {"peer_pid": 0, "req_id": PREFETCH_OWNER})
        try:
            await self.promoter.promote(engine, t.keys, log_extra)
        except Exception as e:  # a tier's failure is counted and logged by the tier; the hint says so
            log.warning("prefetch %s: the reads failed: %s", a.action_id or "(no id)", e)
            return Outcome("prefetch", a.action_id, "rejected", f"the reads failed: {e}", before)
        after = self._hit(t)
        n = len(t.keys)
        if after == n:
            return Outcome("prefetch", a.action_id, "accepted", f"read {after - before} chunks into the pool; the "
                           f"whole prefix ({n} chunks) is there", after)
        if after > before:
            return Outcome("prefetch", a.action_id, "clipped", f"read {after - before} chunks into the pool; chunks "
                           f"{after} to {n - 1} are in no tier this daemon reads (or their reads failed)", after)
        return Outcome("prefetch", a.action_id, "rejected", f"the prefix past chunk {before} is in no tier this "
                       "daemon reads (pool, disk, cluster), or its reads failed: nothing to prefetch", after)

