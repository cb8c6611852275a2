"""Stores: an engine's blocks copied into new pool entries, and offered to the lower tiers once READY.

Role
    Serves ``Store`` and writes the Mamba states a step event offers (``write_items`` with ``pending``:
    the entries stay unconfirmed until the engine's later step event confirms them). Remembers where
    turn ends end (``Store.turn_end``) for lookups to name. A store is all or nothing: items are
    checked before any write, and a failed or aborted copy gives back every entry it began.

Threading
    Event loop; the copies run through ``Copies``. Write-behind to the disk and cluster tiers keeps an
    entry pinned until each tier that took it is done.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from hkvd.daemon.cache import Cache, Entry, EntryState, Extent, NotAdmitted, mamba_checkpoint_keep
from hkvd.daemon.engines.connection import registered_engine
from hkvd.daemon.tiers.contract import skipped_names
from hkvd.transport import layout
from hkvd.transport.copy_engine import Direction
from hkvd.transport.errors import Aborted, OutOfRange, PoolFull
from hkvd.transport.keys import ROOT_KEY
from hkvd.transport.tier_matchers import POOL
from hkvd.transport.wire.kv import StoreResult

if TYPE_CHECKING:
    from hkvd.daemon.config import ConfigCell
    from hkvd.daemon.engines.connection import Conn
    from hkvd.daemon.engines.copies import Copies
    from hkvd.daemon.engines.engine_traffic import EngineTraffic
    from hkvd.daemon.engines.registry import EngineState
    from hkvd.daemon.metrics import Metrics
    from hkvd.daemon.routing.announcer import Announcer
    from hkvd.daemon.tiers.contract import Tier
    from hkvd.transport.layout import GroupSpec
    from hkvd.transport.wire import kv
    from hkvd.transport.wire.block_notes import BlockNote
    from hkvd.transport.wire.kv import Item


# What became of engines' store entries (hkvd_store_entries_total{outcome}, hkvd_store_bytes_total{outcome}):
# stored, or not: present (the pool had it already), admission (--admission refused it), no_room (the pool was full
# of entries it may not evict), thinned (a Mamba state between checkpoints, --mamba-checkpoint-interval),
# store_tiers (the request's kv_store_tiers leave the pool out).
STORE_OUTCOMES = ("stored", "present", "admission", "no_room", "thinned", "store_tiers")


def count_bytes(metrics: Metrics, name: str, entries: list[Entry]) -> int:
    """Count ``entries``' bytes under ``name`` by group kind; their total."""
    by_kind: dict[str, int] = {}
    for e in entries:
        by_kind[e.kind] = by_kind.get(e.kind, 0) + e.nbytes
    for kind, n in by_kind.items():
        metrics.inc(name, n, kind=kind)
    return sum(by_kind.values())


class Stores:
    """Writes into the pool. ``announcer``: KV-event notes are checked and announced, or None: ignored."""

    def __init__(self, config: ConfigCell, index: Cache, copies: Copies, metrics: Metrics, traffic: EngineTraffic,
                 tiers: list[Tier[object]], announcer: Announcer | None) -> None:
        self.config = config
        self.index = index
        self.copies = copies
        self.metrics = metrics
        self.traffic = traffic
        self.tiers = tiers  # local before remote
        self.announcer = announcer

    async def store(self, conn: Conn, msg: kv.Store) -> None:
        engine = registered_engine(conn, copy=True)
        items = msg.items
        notes = self.check_notes(engine, msg.parsed_notes(), items)
        parent = self._turn_end_parent(engine, msg) if msg.turn_end else None
        if msg.skip_tiers & POOL:  # its store tiers leave the pool out: every tier below is written from the pool
            groups = [engine.check_item(it) for it in items]
            self.count_outcome("store_tiers", len(items), sum(engine.entry_bytes[g.group_id] for g in groups))
            conn.send(StoreResult(msg.req_id, 0, 0, 0, len(items), 0))
            return
        stored, _ = await self.write_items(conn, engine, items, job_id=msg.req_id, pending=False,
                                           wait_event=msg.wait_event, notes=notes, tenant=msg.tenant,
                                           exempt=bool(msg.turn_end), skip_tiers=msg.skip_tiers)
        if parent is not None:
            self.index.add_turn_end(engine.world_fingerprints[0], parent, msg.turn_end)
        conn.send(stored)

    async def write_items(self, conn: Conn, engine: EngineState, items: list[Item], *, job_id: int,
                          pending: bool, wait_event: bytes = b"", notes: list[BlockNote] | None = None,
                          tenant: str | Sequence[str] = "", exempt: bool = False, skip_tiers: int = 0,
                          ) -> tuple[StoreResult, list[Entry]]:
        """Copy ``items`` into new pool entries of ``tenant`` (one for all, or one per item); the reply to job
        ``job_id`` with their counts, and the entries written.

        ``pending``: a step event's states, unconfirmed, whose copy has a deadline (``step_executor``). ``exempt``:
        always admitted (a turn end; ``--admission``). ``skip_tiers``: the tiers below the pool the request's store
        tiers leave out (``hkvd.transport.tier_matchers`` bits): its entries are not written to them."""
        groups = [engine.check_item(it) for it in items]  # all or nothing: check before any write
        announcer = self.announcer if notes else None
        tenants = [tenant] * len(items) if isinstance(tenant, str) else list(tenant)
        keep, kept_tenants, thinned = self._thin(engine, items, groups, tenants)
        entries, placed, skipped, dropped = self._begin(engine, keep, kept_tenants, job_id, exempt)
        nbytes = 0
        try:  # from here on, any failure gives back every entry begun above
            segments = layout.segments_for_entries(placed)
            if segments:
                nbytes = (await self.copies.run(conn, engine.attachment, segments, Direction.TO_POOL,
                                                wait_event, urgent=pending))[0].nbytes
        except BaseException as exc:
            self.copies.release_after(exc, functools.partial(self._abandon_writes, entries))
            raise
        if job_id in conn.aborted:
            self._abandon_writes(entries)
            conn.aborted.discard(job_id)
            raise Aborted(f"job {job_id} was aborted by the client; nothing was stored")
        # Notes first: the entries are announced as they turn READY (stored; Mamba states on confirmation).
        noted = announcer.accept(engine, notes or []) if announcer is not None else []
        self.index.complete_store(entries, pending=pending)
        if announcer is not None:
            announcer.settle(engine, noted)
        if not pending:
            self.write_behind(entries, skip_tiers)
        self.count_outcome("stored", len(entries), sum(e.nbytes for e in entries))
        self.traffic.stored(engine.spec.model, engine.spec.rank, count_bytes(self.metrics, "stored_bytes", entries))
        return StoreResult(job_id, nbytes, len(entries), skipped, dropped, thinned), entries

    def _thin(self, engine: EngineState, items: list[Item], groups: list[GroupSpec],
              tenants: list[str]) -> tuple[list[tuple[Item, GroupSpec]], list[str], int]:
        """The items to store and their tenants, less the Mamba states between checkpoints
        (``mamba_checkpoint_interval``); how many those were."""
        keep: list[tuple[Item, GroupSpec]] = []
        kept_tenants: list[str] = []
        thinned = 0
        interval = self.config.current.mamba_checkpoint_interval
        for it, g, t in zip(items, groups, tenants, strict=True):
            if g.kind == "mamba" and not mamba_checkpoint_keep(it.chunk_index, interval):
                thinned += 1
                self.metrics.inc("mamba_states_thinned")
                self.metrics.inc("mamba_bytes_saved", engine.entry_bytes[g.group_id])
                self.count_outcome("thinned", 1, engine.entry_bytes[g.group_id])
                continue
            keep.append((it, g))
            kept_tenants.append(t)
        return keep, kept_tenants, thinned

    def _begin(self, engine: EngineState, keep: list[tuple[Item, GroupSpec]], tenants: list[str], job_id: int,
               exempt: bool = False,
               ) -> tuple[list[Entry], list[tuple[GroupSpec, list[int], tuple[Extent, ...]]], int, int]:
        """Begin an entry for each of ``keep``: (the entries begun, where each one's blocks go, how many
        were held already (skipped), how many the pool had no room for or the admission refused (dropped))."""
        fp, sizes = engine.fingerprint, engine.entry_bytes
        begun = self.index.begin_store([((fp, g.group_id, it.key), sizes[g.group_id], g.kind, it.parent)
                                        for it, g in keep], job_id, tenants,
                                       chunks=[it.chunk_index for it, _ in keep], offered=True, exempt=exempt)
        entries: list[Entry] = []
        placed: list[tuple[GroupSpec, list[int], tuple[Extent, ...]]] = []
        skipped = dropped = 0
        for (it, g), got in zip(keep, begun, strict=True):
            if got is None:
                skipped += 1
                self.count_outcome("present", 1, sizes[g.group_id])
            elif isinstance(got, NotAdmitted):  # counted by the cache (admission_entries) too
                dropped += 1
                self.count_outcome("admission", 1, sizes[g.group_id])
            elif isinstance(got, PoolFull):
                dropped += 1
                self.index.note_store_dropped()
                self.metrics.inc("stores_dropped", kind=g.kind)
                self.count_outcome("no_room", 1, sizes[g.group_id])
            else:
                entries.append(got)
                placed.append((g, it.block_ids, got.alloc.extents))
        return entries, placed, skipped, dropped

    def _abandon_writes(self, entries: list[Entry]) -> None:
        self.index.abandon_store(entries)

    def count_outcome(self, outcome: str, entries: int, nbytes: int) -> None:
        """Count ``entries`` entries (``nbytes`` bytes) of engines' stores by what became of them: ``stored``, or
        why not (``STORE_OUTCOMES``)."""
        if entries:
            self.metrics.inc("store_entries", entries, outcome=outcome)
            self.metrics.inc("store_bytes", nbytes, outcome=outcome)

    def write_behind(self, entries: list[Entry], skip_tiers: int = 0) -> None:
        """Offer READY entries to each lower tier but those ``skip_tiers`` leaves out (a request's store tiers);
        an entry stays pinned until each tier that took it is done. (Reads from the tiers:
        daemon/tiers/promotion.py.)"""
        left_out = skipped_names(skip_tiers)
        for tier in self.tiers:
            if tier.name in left_out:
                ready = [e for e in entries if e.state is EntryState.READY]
                if ready:
                    self.metrics.inc("tier_writes_left_out", len(ready), tier=tier.name)
                    self.metrics.inc("tier_bytes_left_out", sum(e.nbytes for e in ready), tier=tier.name)
                continue
            for e in entries:
                if e.state is not EntryState.READY:
                    continue
                unpin = self.index.pin_for_read([e])  # until the tier's write is done
                if not tier.offer(e.key, e.kind, e.nbytes, e.parent, e.alloc.extents, unpin):
                    unpin()

    def check_notes(self, engine: EngineState, notes: list[BlockNote], items: list[Item]) -> list[BlockNote]:
        """The message's KV-event notes, checked against the engine and its items (``OutOfRange``); none
        when this daemon keeps no KV events."""
        if not notes or self.announcer is None:
            return []
        self.announcer.check(engine, notes, items)
        return notes

    @staticmethod
    def _turn_end_parent(engine: EngineState, msg: kv.Store) -> bytes:
        """The key of the whole chunk before the turn end ``msg`` stores (``ROOT_KEY`` for chunk 0); raise
        ``OutOfRange`` when its items are not one partial chunk ending ``msg.turn_end`` into a chunk."""
        items = msg.items
        j = items[0].chunk_index if items else 0
        if (not items or any((it.key, it.chunk_index, it.parent) != (items[0].key, j, items[0].parent) for it in items)
                or not msg.turn_end < engine.chunk_size or (j and not items[0].parent)):
            raise OutOfRange(f"Store.turn_end {msg.turn_end}: the items of a turn end must be one partial chunk (one "
                             f"key and chunk index, the parent key named past chunk 0) ending inside a chunk of "
                             f"{engine.chunk_size} tokens")
        return items[0].parent if j else ROOT_KEY
