"""Promotion: the one read-through path that lookups share, from the tiers below the pool (disk, cluster).

Role
    A lookup whose pool hit is short asks the lower tiers for the entries the hit needs
    (``Cache.plan_lookup`` over the pool and what the tiers hold), has them read into fresh pool
    entries (``Cache.begin_store``/``complete_store``, as a store) and re-plans; ``KVService`` then
    answers from the pool alone, so a lookup never promises what a read failed to bring (a retrieve is served
    from the pool only). ``Tier`` (``daemon/tiers/contract.py``) is what a tier offers the service:
    reads for this path (``Promoter.promote``) and write-behind (``offer``). The disk tier
    (``daemon/tiers/disk.py``) and the cluster tier (``daemon/tiers/cluster.py``) implement it.

Order and budget
    Tiers are asked in the order given (disk before cluster: local before remote). ``holds`` is
    asked once per lookup for every entry the pool lacks; a key is read from the first tier that
    holds it. Each tier's work for one lookup (its ``holds`` and its reads) fits in the tier's
    ``budget_s``, counted from the start of the lookup; what does not is given up (``timeout``)
    and the lookup goes on without it.

Threading and pages
    Event loop only; ``holds`` may await the tier's own threads, ``read_batch`` runs on the tier's
    ``executor``. A read lands in WRITING entries (pinned, never served); on success they become
    READY, otherwise they are dropped. A read that outlives its budget keeps its pages until its
    thread returns, then they are freed. While it reads, a lease pins the pool entries the plan
    already counts on, so the reads' allocations cannot evict them (in a nearly full pool that would
    leave the hit shorter than the pool alone served); it ends before ``promote`` returns. Two
    lookups that want the same key share one read.

Metrics (``Metrics``, by tier name ``l2`` or ``cluster``)
    ``<name>_hits`` by kind: entries read and verified; ``<name>_read_failures`` by reason
    (``timeout``, ``pool_full``, ``gone``, ``layout``, and the tier's own: ``checksum``, ``io``...).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Container, Sequence
from typing import TYPE_CHECKING

from hkvd.daemon.cache import Cache, Entry, EntryKey, Tail
from hkvd.daemon.engines.registry import EngineState
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.tiers.contract import Tier
from hkvd.transport.errors import PoolFull

if TYPE_CHECKING:  # for annotations only: the service imports this module
    from hkvd.daemon.engines.connection import RequestLog

log = logging.getLogger("hkvd.tiers")

# Rounds of "plan with the tiers, read what the plan needs": a failed read re-plans without it.
PROMOTE_ROUNDS = 3
PROMOTION_OWNER = -1  # the owner of promotion's own leases (engines' connections are numbered from 1)


class Promoter:
    """Reads into the pool what a short lookup's best hit over pool + tiers needs (module docstring)."""

    def __init__(self, index: Cache, metrics: Metrics, tiers: Sequence[Tier[object]]) -> None:
        self.index = index
        self.metrics = metrics
        self.tiers = list(tiers)
        self._promoting: dict[EntryKey, asyncio.Future[None]] = {}  # reads in flight, by key

    def usable(self, skip: Container[str] = ()) -> bool:
        """Whether any tier but those named in ``skip`` (a request's load tiers leave them out) is worth asking."""
        return any(t.usable() for t in self.tiers if t.name not in skip)

    async def promote(self, engine: EngineState, keys: list[bytes], log_extra: RequestLog,
                      tails: Sequence[Tail] = (), skip: Container[str] = ()) -> bool:
        """Read what the best hit over the pool and the tiers needs and only the tiers have (the plan is the
        cache's: ``Cache.plan_lookup``, ``tails`` included); True if any entry was read. The tiers named in
        ``skip`` are neither asked nor read (the request's load tiers leave them out)."""
        loop = asyncio.get_running_loop()
        tiers = [t for t in self.tiers if t.usable() and t.name not in skip]
        deadlines = {t.name: loop.time() + t.budget_s for t in tiers}
        held = await self._held(tiers, engine, [*keys, *(key for _, key in tails)], deadlines, log_extra)
        failed: set[EntryKey] = set()

        def has(k: EntryKey) -> bool:  # in a tier whose read has not failed
            return k not in failed and k in held

        promoted = False
        pin = 0  # a lease on the pool's part of the plan: the reads' allocations must not evict it
        ttl_s = max((t.budget_s for t in tiers), default=0.0) + 1.0
        try:
            for _ in range(PROMOTE_ROUNDS):
                if not held:
                    break
                plan = self.index.plan_lookup(engine, keys, engine.rank_fingerprints, tails=tails, tiers=has)
                if not plan.promote:
                    break
                if pin:
                    self.index.release(pin)
                pin = self.index.lease(plan, PROMOTION_OWNER, ttl_s)  # holds the READY part; serves nothing
                by_tier: dict[str, list[tuple[EntryKey, bytes]]] = {}
                for k, parent in plan.promote:
                    by_tier.setdefault(held[k].name, []).append((k, parent))
                results = await asyncio.gather(*[
                    self._promote(next(t for t in tiers if t.name == name), engine, part, deadlines[name],
                                  log_extra) for name, part in by_tier.items()])
                bad = set().union(*results)
                promoted = promoted or len(bad) < len(plan.promote)
                if not bad:
                    break
                failed.update(bad)
        finally:
            if pin:  # the caller plans again at once, without yielding: nothing is evicted in between
                self.index.release(pin)
        return promoted

    async def _held(self, tiers: list[Tier[object]], engine: EngineState, keys: list[bytes],
                    deadlines: dict[str, float], log_extra: RequestLog) -> dict[EntryKey, Tier[object]]:
        """The first of ``tiers`` that holds each entry of ``keys`` the pool lacks (each tier asked once)."""
        ready, fps = self.index.is_ready, engine.rank_fingerprints
        lacking = [k for key in keys for gid in engine.groups for fp in fps
                   if not ready(k := (fp, gid, key))] if tiers else []
        held: dict[EntryKey, Tier[object]] = {}
        for tier in tiers:
            asked = [k for k in lacking if k not in held]
            if not asked:
                break
            try:
                async with asyncio.timeout_at(deadlines[tier.name]):
                    got = await tier.holds(asked)
            except TimeoutError:
                self.metrics.inc(f"{tier.name}_read_failures", reason="timeout")
                log.info("%s: no answer within %.3f s; the lookup goes on without it", tier.label, tier.budget_s,
                         extra=log_extra)
                continue
            for k in got:
                held.setdefault(k, tier)
        return held

    async def _promote(self, tier: Tier[object], engine: EngineState,
                       wanted: list[tuple[EntryKey, bytes]], deadline: float,
                       log_extra: RequestLog) -> set[EntryKey]:
        """Read ``wanted`` from ``tier`` into fresh pool entries; return the keys that did not make it."""
        bad: set[EntryKey] = set()
        jobs: list[tuple[Entry, object]] = []
        others: list[tuple[EntryKey, asyncio.Future[None]]] = []
        for k, parent in wanted:
            if (fut := self._promoting.get(k)) is not None:  # another lookup is reading it already
                others.append((k, fut))
                continue
            group = engine.groups[k[1]]
            nbytes = engine.entry_bytes[group.group_id]
            src = tier.source(k, nbytes, group.kind, parent)
            if isinstance(src, str):
                self.metrics.inc(f"{tier.name}_read_failures", reason=src)
                bad.add(k)
                continue
            [entry] = self.index.begin_store([(k, nbytes, group.kind, src.parent)], 0)
            if isinstance(entry, PoolFull):
                self.metrics.inc(f"{tier.name}_read_failures", reason="pool_full")
                bad.add(k)
                continue
            if entry is None:  # a store is writing this key right now: not servable yet
                bad.add(k)
                continue
            jobs.append((entry, src.handle))
        if jobs:
            done = asyncio.get_running_loop().create_future()
            for e, _ in jobs:
                self._promoting[e.key] = done
            try:
                bad |= await self._read(tier, jobs, deadline, log_extra)
            finally:
                for e, _ in jobs:
                    self._promoting.pop(e.key, None)
                done.set_result(None)
        for k, fut in others:
            await asyncio.shield(fut)  # bounded: that lookup's read has its own budget
            if not self.index.is_ready(k):
                bad.add(k)
        return bad

    async def _read(self, tier: Tier[object], jobs: list[tuple[Entry, object]], deadline: float,
                    log_extra: RequestLog) -> set[EntryKey]:
        loop = asyncio.get_running_loop()
        n = max(1, min(tier.read_threads, len(jobs)))
        parts = [jobs[i::n] for i in range(n)]
        reads = asyncio.gather(*[loop.run_in_executor(tier.executor, tier.read_batch,
                                                      [(e.key, h, e.alloc.extents) for e, h in part])
                                 for part in parts])
        def abandon(_: object) -> None:  # the threads still write into these pages: freed once the reads return
            self.index.abandon_store(e for e, _h in jobs)

        try:
            async with asyncio.timeout_at(deadline):
                results = await asyncio.shield(reads)
        except asyncio.CancelledError:  # the daemon stops (a deferred prefetch, Hints.drain)
            reads.add_done_callback(abandon)
            raise
        except TimeoutError:
            reads.add_done_callback(abandon)
            self.metrics.inc(f"{tier.name}_read_failures", len(jobs), reason="timeout")
            log.warning("%s: reading %d entries took longer than %.3f s; the lookup goes on without them",
                        tier.label, len(jobs), tier.budget_s, extra=log_extra)
            return {e.key for e, _ in jobs}
        bad: set[EntryKey] = set()
        for part, errors in zip(parts, results, strict=True):
            for (e, _h), err in zip(part, errors, strict=True):
                if err is None:
                    self.index.complete_store([e], pending=False)
                    self.metrics.inc(f"{tier.name}_hits", kind=e.kind)
                    continue
                self.index.abandon_store([e])
                bad.add(e.key)
                reason = getattr(err, "reason", "io")
                self.metrics.inc(f"{tier.name}_read_failures", reason=reason)
                log.info("%s: entry not served (%s: %s)", tier.label, reason, err, extra=log_extra)
        return bad
