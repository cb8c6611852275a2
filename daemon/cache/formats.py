"""The one record of engine formats: every engine world registered here, kept after it leaves.

Role
    An engine world is the rank fingerprints of one tensor-parallel engine (``rank_fingerprints``:
    every rank's entries have the same format). ``Formats`` keeps, per world, what the hit rule and
    the views above the cache need: model name, chunk size, group rules, kinds, entry sizes, which
    ranks registered, and when. It is fed where engines register (``Registry.register`` and
    ``unregister``) and read by the peer view (``daemon/peers/layout_book.py``: the ranks that
    registered), the routing view (``daemon/routing/usable_prefix.py``: labels on top) and the KV-event
    announcer (``daemon/routing/announcer.py``: its event naming on top).

Bounds
    At most ``max_worlds`` worlds (``MAX_WORLDS``); past that, the world registered least recently is
    forgotten first. The world registered last is kept, and no world is forgotten while an engine of
    it is registered (``live``) or a reader holds it (``hold``: the announcer, while it keeps notes
    of the world's chunks), so the record exceeds the bound only by such worlds.

Threading
    Event-loop only.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from hkvd.daemon.cache.hybrid import GroupRule
from hkvd.transport.reshard import ShardShape
from hkvd.transport.wire.control import EngineSpec

MAX_WORLDS = 64

World = tuple[bytes, ...]  # every rank's fingerprint, in rank order


@dataclass(slots=True)
class WorldFormat:
    """One engine world's format, as registration gave it."""

    fingerprints: World
    model: str
    chunk_size: int
    rules: tuple[GroupRule, ...]
    kinds: dict[int, str]
    entry_bytes: dict[int, int]
    ranks: set[int] = field(default_factory=set)  # the ranks that registered (indexes of ``fingerprints``)
    registered: float = 0.0  # wall-clock time of the last registration
    live: int = 0  # engines of this world registered now
    held: int = 0  # readers holding it (``Formats.hold``)
    # The TP-free model digest (registry.model_key) and what re-sharding needs (transport/reshard.py); b"" and
    # None for an engine that registered no model identity: its entries are read at its own TP size only.
    model_key: bytes = b""
    shard: ShardShape | None = None
    # The registration that fixed this format, without its regions and with the chunk size the daemon chose
    # (None: one without a model identity). A serving daemon hands it to peers of another TP size of the model
    # (daemon/peers/serving.py), which derive the world's fingerprints and shape from it (``Formats.learn``).
    spec: EngineSpec | None = None

    def rank_of(self, fingerprint: bytes) -> int:
        return self.fingerprints.index(fingerprint)


class Formats:
    """Engine worlds by any rank's fingerprint (module docstring)."""

    def __init__(self, max_worlds: int = MAX_WORLDS) -> None:
        if max_worlds < 1:
            raise ValueError(f"max_worlds must be at least 1 (got {max_worlds})")
        self.max_worlds = max_worlds
        self._worlds: collections.OrderedDict[World, WorldFormat] = collections.OrderedDict()  # oldest first
        self._by_fp: dict[bytes, World] = {}
        self.version = 0  # changes whenever a world is added, registered again or forgotten

    def add(self, fingerprints: Sequence[bytes], rank: int, *, model: str, chunk_size: int,
            rules: Sequence[GroupRule], kinds: dict[int, str], entry_bytes: dict[int, int],
            live: bool = False, model_key: bytes = b"", shard: ShardShape | None = None,
            spec: EngineSpec | None = None) -> WorldFormat:
        """A registration of ``rank`` of the world ``fingerprints`` (``live``: by an engine that will
        ``leave``). The first registration of a world fixes its format; each one makes it the newest."""
        fps = tuple(fingerprints)
        if not 0 <= rank < len(fps):
            raise ValueError(f"rank {rank} is outside a world of {len(fps)} ranks")
        w = self._world_of(fps, model, chunk_size, rules, kinds, entry_bytes, model_key, shard, spec)
        w.ranks.add(rank)
        w.registered = time.time()
        w.live += live
        self._worlds.move_to_end(fps)
        self.version += 1
        self._trim()
        return w

    def learn(self, fingerprints: Sequence[bytes], *, model: str, chunk_size: int, rules: Sequence[GroupRule],
              kinds: dict[int, str], entry_bytes: dict[int, int], model_key: bytes, shard: ShardShape,
              spec: EngineSpec | None = None) -> WorldFormat:
        """A world no engine registered here, whose entries this daemon holds: another TP size's, pulled from a
        peer (daemon/peers/tp_pulls.py) to be read re-sharded. No rank counts as registered (a serving daemon
        never offers it to its own peers); it is the newest world until another is added."""
        fps = tuple(fingerprints)
        w = self._world_of(fps, model, chunk_size, rules, kinds, entry_bytes, model_key, shard, spec)
        w.registered = time.time()
        self._worlds.move_to_end(fps)
        self.version += 1
        self._trim()
        return w

    def _world_of(self, fps: World, model: str, chunk_size: int, rules: Sequence[GroupRule], kinds: dict[int, str],
                  entry_bytes: dict[int, int], model_key: bytes, shard: ShardShape | None,
                  spec: EngineSpec | None) -> WorldFormat:
        w = self._worlds.get(fps)
        if w is None:
            w = WorldFormat(fps, model, chunk_size, tuple(rules), dict(kinds), dict(entry_bytes),
                            model_key=model_key, shard=shard, spec=spec)
            self._worlds[fps] = w
            for fp in fps:
                self._by_fp[fp] = fps
        elif w.spec is None and spec is not None:
            w.spec = spec
        return w

    def leave(self, fingerprints: Sequence[bytes]) -> None:
        """An engine of the world (registered ``live``) unregistered; its format stays."""
        w = self._worlds.get(tuple(fingerprints))
        if w is not None and w.live > 0:
            w.live -= 1
            self._trim()

    def hold(self, fingerprint: bytes) -> None:
        """Keep the world of ``fingerprint`` (any rank's) until ``release`` (one release per hold)."""
        w = self.world(fingerprint)
        if w is None:
            raise KeyError(f"no world has the fingerprint {fingerprint.hex()[:12]}; add it before holding it")
        w.held += 1

    def release(self, fingerprint: bytes) -> None:
        """End one ``hold`` of the world of ``fingerprint``."""
        w = self.world(fingerprint)
        if w is not None and w.held > 0:
            w.held -= 1
            self._trim()

    def world(self, fingerprint: bytes) -> WorldFormat | None:
        """The world one of whose ranks has ``fingerprint`` (registered or not), if known; of the replicated
        worlds of one model at several TP sizes, which share it, the one added last (the same format per rank)."""
        key = self._by_fp.get(fingerprint)
        return self._worlds[key] if key is not None else None

    def same_model(self, model_key: bytes, besides: World) -> list[WorldFormat]:
        """The other worlds of the model ``model_key`` (other TP sizes), the most recently registered first."""
        if not model_key:
            return []
        return [w for w in reversed(self._worlds.values()) if w.model_key == model_key and w.fingerprints != besides]

    def worlds(self) -> list[WorldFormat]:
        """Every known world, the least recently registered first."""
        return list(self._worlds.values())

    def __len__(self) -> int:
        return len(self._worlds)

    def _trim(self) -> None:
        excess = len(self._worlds) - self.max_worlds
        if excess <= 0:
            return
        newest = next(reversed(self._worlds))  # the world registered last stays
        for fps in [k for k, w in self._worlds.items() if not w.live and not w.held and k != newest][:excess]:
            del self._worlds[fps]
            for fp in fps:
                if self._by_fp.get(fp) == fps:
                    # Replicated worlds of one model at other TP sizes share their fingerprint: name one left.
                    other = next((k for k in reversed(self._worlds) if fp in k), None)
                    if other is None:
                        del self._by_fp[fp]
                    else:
                        self._by_fp[fp] = other
            self.version += 1
