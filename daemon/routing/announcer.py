"""Which tier holds which chunk, told to routers as vLLM KV events under vLLM's own block hashes.

Role
    The engine's scheduler side sends a *note* with each chunk it stores (``Store.notes``,
    ``StepEvent.notes``; ``hkvd.transport.wire.block_notes``): vLLM's hashes of the chunk's
    blocks, its parent hash, tokens, extra keys and adapter. The announcer keeps a note while any
    tier holds the chunk, follows the cache (``Cache.subscribe``: ready and drop) and the tiers'
    membership changes (``tier_changed``), and publishes per group and tier (``medium``):

    - ``BlockStored(medium)`` when the tier starts holding the group's entry: the pool when it
      turns READY (a Mamba state once its engine confirmed it), the disk tier when its file is
      written, the cluster tier when this node's put succeeded;
    - ``BlockRemoved(medium)`` when it stops: evicted or dropped from the pool, deleted from the
      disk tier (its cap, a failed check), found gone from or removed by this node in the cluster.

    Each medium is announced on its own: a chunk evicted from the pool but kept on disk gets
    ``BlockRemoved(HKVD_POOL)`` and stays announced as ``HKVD_DISK``; read back into the pool, it
    gets ``BlockStored(HKVD_POOL)`` again. With tensor parallelism an engine's chunk is one entry
    per rank: a tier holds it (and it is announced, once) only while it holds every rank's entry.

Partial chunks
    A partial chunk's note (``block_notes.is_partial``) names one block of vLLM's hash unit ending where
    the chunk ends: it is announced in each group the chunk holds as that block (``block_size`` the
    unit), as vLLM announces its own partial entries.

Identity
    A unit is (layout, group, chunk key); the layout is the rank-0 fingerprint of the engine world.
    A world's ranks come from the cache's record of engine formats (``Cache.formats``,
    ``hkvd.daemon.cache.Formats``); the announcer keeps only how each world's events are named
    (``World``), and holds a world in the record while it keeps notes of its chunks. Engines of the
    same layout share entries, so they share announcements: a chunk stored by one engine is
    announced once for all. Notes are kept per (layout, chunk key); the first note of a chunk wins
    (the same tokens and extras give the same hashes under the same hash settings, which every
    engine of a fleet and its indexer must share: docs/routing.md).

    Events name no tenant: a note never carries a ``cache_salt`` (the shim strips it from the extra
    keys), and a salted chunk is announced under the hashes vLLM computed with the salt only.

What is not announced
    Chunks without a note: stored by an older shim or one with events off, pulled from a peer
    without a local note, or found in the disk tier at start-up (notes are kept in memory only).
    Cluster values that Mooncake evicts on its own are withdrawn only when this node sees them
    gone; at most ``max_cluster_units`` units are announced there (the oldest is withdrawn first).

Threading
    Event loop only. The tiers' threads report through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from hkvd.daemon.cache import Cache, Entry, EntryKey, Formats
from hkvd.daemon.engines.registry import EngineState
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.routing.kv_events import (
    MEDIA,
    MEDIUM_CLUSTER,
    MEDIUM_DISK,
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventLog,
)
from hkvd.transport.errors import OutOfRange
from hkvd.transport.stat_fields import status_only
from hkvd.transport.wire.block_notes import BlockNote, ExternalHash, check_against, is_partial
from hkvd.transport.wire.events import MAX_POLL_BATCHES, KVEvents
from hkvd.transport.wire.kv import Item

log = logging.getLogger("hkvd.routing")

# vLLM's kv_cache_spec_kind for hkvd's group kinds, for engines that register no event_groups.
DEFAULT_EVENT_KINDS = {"full": "full_attention", "swa": "sliding_window", "mamba": "mamba"}
DEFAULT_MAX_CLUSTER_UNITS = 1 << 16


@dataclass(frozen=True, slots=True)
class GroupMeta:
    kind: str  # hkvd's: full | swa | mamba
    event_kind: str  # vLLM's kv_cache_spec_kind
    window: int | None  # vLLM's kv_cache_spec_sliding_window
    block_size: int


@dataclass(frozen=True, slots=True)
class World:
    """How the events of one engine world are named (its ranks are the cache's record's)."""

    fp0: bytes  # the world's rank-0 fingerprint: the layout
    block_size: int
    groups: dict[int, GroupMeta]
    topic: bytes


def world_of(state: EngineState, topic_template: str) -> World:
    spec = state.spec
    named = {gid: (kind, window) for gid, kind, window in spec.event_groups}
    groups = {}
    for gid, g in state.groups.items():
        kind, window = named.get(gid, (DEFAULT_EVENT_KINDS.get(g.kind, "unknown"),
                                       g.window_tokens if g.kind == "swa" else None))
        groups[gid] = GroupMeta(g.kind, kind, window, g.tokens_per_block)
    block = spec.block_size or min(g.tokens_per_block for g in state.groups.values())
    fps = state.world_fingerprints
    return World(fps[0], block, groups, topic_template.replace("{model}", spec.model).encode())


@dataclass(frozen=True, slots=True)
class AnnouncerStats:
    """KV events kept and announced (``hkvd status``: ``kv_events``)."""

    notes: int = status_only()  # block notes held for announcing entries
    announced: dict[str, int] = status_only()  # units announced now, per medium
    layouts: int = status_only()
    events: int = status_only()
    batches: int = status_only()
    next_seq: int = status_only()


class Announcer:
    def __init__(self, index: Cache, events: EventLog, metrics: Metrics, *, topic: str = "",
                 disk: Callable[[EntryKey], bool] | None = None,
                 max_cluster_units: int = DEFAULT_MAX_CLUSTER_UNITS) -> None:
        """``disk(key)``: whether the disk tier holds the entry (None: no disk tier)."""
        self.index = index
        self.events = events
        self.metrics = metrics
        self.topic = topic
        self.disk = disk
        self.max_cluster_units = max_cluster_units
        self.formats: Formats = index.formats  # every rank's fingerprint -> its world
        self._named: dict[bytes, World] = {}  # layout -> how its events are named
        self._notes: dict[tuple[bytes, bytes], BlockNote] = {}  # (layout, chunk key) -> note
        self._noted: dict[bytes, int] = {}  # layout -> notes kept (the world is held in ``formats`` while > 0)
        self._announced: dict[EntryKey, frozenset[str]] = {}  # unit -> media announced
        self._counts: dict[str, int] = dict.fromkeys(MEDIA, 0)  # units announced, per medium
        self._cluster: collections.OrderedDict[EntryKey, None] = collections.OrderedDict()  # rank keys put
        self._opened: set[bytes] = set()
        self._unsubscribe = index.subscribe(ready=self._on_ready, drop=self._on_drop)

    # ---- set-up --------------------------------------------------------------------------------
    def start(self) -> None:
        """A topic without ``{model}`` opens now: its subscribers learn at once that what an earlier
        run of the daemon announced is gone."""
        if "{model}" not in self.topic:
            self._open(self.topic.encode())

    def _open(self, topic: bytes) -> None:
        if topic not in self._opened:
            self._opened.add(topic)
            self.events.add(b"", topic, AllBlocksCleared())

    def close(self) -> None:
        """The daemon stops and its pool goes: ``AllBlocksCleared`` on every topic it opened, sent now. Later
        changes are not announced."""
        for topic in sorted(self._opened):
            self.events.add(b"", topic, AllBlocksCleared())
        self.events.flush()
        self._unsubscribe()
        self._announced.clear()
        self._notes.clear()
        for fp0 in self._noted:
            self.formats.release(fp0)
        self._noted.clear()
        self._counts = dict.fromkeys(MEDIA, 0)

    def register(self, state: EngineState) -> None:
        """An engine registered: know how its world's events are named (kept after it leaves, as its
        entries are). The registry records the world in ``formats``; an engine it did not register is
        recorded here."""
        fps = state.world_fingerprints
        if self.formats.world(fps[0]) is None:
            self.formats.add(fps, fps.index(state.fingerprint), model=state.spec.model, chunk_size=state.chunk_size,
                             rules=state.rules, kinds=state.kinds, entry_bytes=state.entry_bytes)
        if fps[0] in self._named:
            return
        w = world_of(state, self.topic)
        self._open(w.topic)
        self._named[fps[0]] = w

    # ---- notes from the engine -------------------------------------------------------------------
    def check(self, engine: EngineState, notes: list[BlockNote], items: Iterable[Item]) -> None:
        """Refuse (``OutOfRange``) notes that do not fit the engine or name no item of their message."""
        if not notes:
            return
        w = self._world(engine)
        keys = {it.key for it in items}
        for note in notes:
            if note.key not in keys:
                raise OutOfRange(f"a note names chunk key {note.key.hex()[:12]}, which no item of the message "
                                 "stores")
            check_against(note, engine.chunk_size, w.block_size)

    def accept(self, engine: EngineState, notes: list[BlockNote]) -> list[bytes]:
        """Keep the notes of chunks that have none yet (call once their entries are written, before they
        turn READY); return every note's chunk key, for ``settle``."""
        w = self._world(engine)
        for note in notes:
            if (w.fp0, note.key) not in self._notes:
                self._notes[(w.fp0, note.key)] = note
                self._noted[w.fp0] = n = self._noted.get(w.fp0, 0) + 1
                if n == 1:
                    self.formats.hold(w.fp0)
        return [n.key for n in notes]

    def settle(self, engine: EngineState, keys: Iterable[bytes]) -> None:
        """After a write: announce what already held chunks now have a note for, and forget the notes of
        chunks no tier took (a full pool, a thinned Mamba state)."""
        w = self._world(engine)
        for ck in keys:
            for gid in w.groups:
                self._sync(w, gid, ck)
            self._forget_unheld(w, ck)
        # Now rather than at the end of the loop turn: the engine's reply follows, and a poll after it (or a
        # subscriber told of the store) finds the store's events already numbered.
        self.events.flush()

    def _world(self, engine: EngineState) -> World:
        fps = engine.world_fingerprints
        w = self._lookup(fps[0])
        if w is None:
            self.register(engine)
            w = self._named[fps[0]]
        return w

    def _fps(self, w: World) -> tuple[bytes, ...]:
        """Every rank's fingerprint of ``w`` (the record keeps a world while its notes are kept here)."""
        fmt = self.formats.world(w.fp0)
        assert fmt is not None, "a world with notes is held in the record"
        return fmt.fingerprints

    def _lookup(self, fp: bytes) -> World | None:
        """The world of any rank's fingerprint, while the record knows it."""
        fmt = self.formats.world(fp)
        return self._named.get(fmt.fingerprints[0]) if fmt is not None else None

    # ---- changes in the index and the tiers -------------------------------------------------------
    def _on_ready(self, entry: Entry) -> None:
        fp, gid, ck = entry.key
        w = self._lookup(fp)
        if w is not None and (w.fp0, ck) in self._notes:
            self._sync(w, gid, ck)

    def _on_drop(self, entry: Entry) -> None:
        fp, gid, ck = entry.key
        w = self._lookup(fp)
        if w is not None and (w.fp0, ck) in self._notes:
            self._sync(w, gid, ck)
            self._forget_unheld(w, ck)

    def tier_changed(self, medium: str, keys: Iterable[EntryKey], present: bool) -> None:
        """A tier (disk or cluster) took or lost the entries ``keys``: on the loop, after the tier's own
        state changed (the disk tier's catalog is asked again here; the cluster's is kept here)."""
        for key in keys:
            if medium == MEDIUM_CLUSTER:
                if present:
                    self._cluster[key] = None
                    self._cluster.move_to_end(key)
                else:
                    self._cluster.pop(key, None)
            fp, gid, ck = key
            w = self._lookup(fp)
            if w is None or (w.fp0, ck) not in self._notes:
                if medium == MEDIUM_CLUSTER:  # no note: nothing to announce there, nothing to remember
                    self._cluster.pop(key, None)
                continue
            self._sync(w, gid, ck)
            if not present:
                self._forget_unheld(w, ck)
        while len(self._cluster) > self.max_cluster_units:
            old, _ = self._cluster.popitem(last=False)
            fp, gid, ck = old
            w = self._lookup(fp)
            if w is not None:
                self._sync(w, gid, ck)
                self._forget_unheld(w, ck)

    # ---- the core --------------------------------------------------------------------------------
    def _held(self, w: World, gid: int, ck: bytes) -> frozenset[str]:
        keys = [(fp, gid, ck) for fp in self._fps(w)]
        media = []
        is_ready = self.index.is_ready
        if all(is_ready(k) for k in keys):
            media.append(MEDIUM_POOL)
        if self.disk is not None and all(self.disk(k) for k in keys):
            media.append(MEDIUM_DISK)
        if all(k in self._cluster for k in keys):
            media.append(MEDIUM_CLUSTER)
        return frozenset(media)

    def _sync(self, w: World, gid: int, ck: bytes) -> None:
        """Publish the difference between the media that hold unit (w, gid, ck) and those announced."""
        note = self._notes.get((w.fp0, ck))
        g = w.groups.get(gid)
        if note is None or g is None:
            return
        unit = (w.fp0, gid, ck)
        held = self._held(w, gid, ck)
        was = self._announced.get(unit, frozenset())
        if held == was:
            return
        for medium in MEDIA:
            if medium in was and medium not in held:
                self.events.add(w.fp0, w.topic, BlockRemoved(self._hashes(g, note), medium, gid))
                self.metrics.inc("kv_events", type="removed", medium=medium)
                self._counts[medium] -= 1
        for medium in MEDIA:
            if medium in held and medium not in was:
                self.events.add(w.fp0, w.topic, self._stored(g, gid, note, medium))
                self.metrics.inc("kv_events", type="stored", medium=medium)
                self._counts[medium] += 1
        if held:
            self._announced[unit] = held
        else:
            self._announced.pop(unit, None)

    def _forget_unheld(self, w: World, ck: bytes) -> None:
        """Drop the note of ``ck`` once no group of it is announced, in the index or on disk."""
        if (w.fp0, ck) not in self._notes:
            return
        get, disk = self.index.get, self.disk
        for gid in w.groups:
            if (w.fp0, gid, ck) in self._announced:
                return
            for fp in self._fps(w):
                k = (fp, gid, ck)
                if get(k) is not None or (disk is not None and disk(k)):
                    return
        del self._notes[(w.fp0, ck)]
        self._noted[w.fp0] -= 1
        if not self._noted[w.fp0]:
            del self._noted[w.fp0]
            self.formats.release(w.fp0)

    @staticmethod
    def _hashes(g: GroupMeta, note: BlockNote) -> list[ExternalHash]:
        # A Mamba entry is the state after the chunk's last token: vLLM's block at the chunk's end.
        return list(note.hashes[-1:]) if g.kind == "mamba" else list(note.hashes)

    @staticmethod
    def _stored(g: GroupMeta, gid: int, note: BlockNote, medium: str) -> BlockStored:
        hashes = note.hashes
        tokens = note.tokens
        extra = note.extra_keys
        parent = note.parent
        block_size = g.block_size
        if is_partial(note, g.block_size):  # one block of vLLM's hash unit, in every group alike
            block_size = len(tokens) // 4
        elif g.kind == "mamba":
            parent = hashes[-2] if len(hashes) > 1 else parent
            hashes = hashes[-1:]
            tokens = tokens[-4 * g.block_size:]
            extra = extra[-1:] if extra is not None else None
        return BlockStored(
            block_hashes=list(hashes), parent_block_hash=parent,
            token_ids=np.frombuffer(tokens, dtype="<u4").tolist(), block_size=block_size,
            lora_id=note.lora_id, medium=medium, lora_name=note.lora_name,
            # vLLM lists every block's extra keys, None for a block without any.
            extra_keys=list(extra) if extra is not None else [None] * len(hashes),
            group_idx=gid, kv_cache_spec_kind=g.event_kind, kv_cache_spec_sliding_window=g.window,
        )

    # ---- the connector's path ----------------------------------------------------------------------
    def poll(self, engine: EngineState, req_id: int, since: int) -> KVEvents:
        w = self._world(engine)
        ans = self.events.since(w.fp0, since, MAX_POLL_BATCHES)
        return KVEvents(req_id, ans.next, ans.lost, ans.payloads)

    def statistics(self) -> AnnouncerStats:
        return AnnouncerStats(notes=len(self._notes), announced=dict(self._counts),
                              layouts=len(self._named), events=self.events.events,
                              batches=self.events.batches, next_seq=self.events.next_seq)
