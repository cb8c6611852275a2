"""Entries across tensor-parallel sizes: lookups that miss in their own world's format, served by re-sharding.

Role
    Entries stay per rank, in the format of the world that stored them. An engine world that misses in its
    own format is offered the worlds of the same model at other TP sizes (``Formats.same_model``: the
    TP-free model digest, ``registry.model_key``) whose shapes it can read (``transport.reshard.refusal``):
    ``plan`` is the longest hit every rank of one such world holds, leased for one retrieve per reader rank;
    ``read`` serves a reader rank's retrieve from the source ranks that hold its heads (and its parts of the
    GDN states), assembling each of its blocks from byte ranges of several entries
    (``transport.reshard.segments``). A world this engine's world cannot read (Mamba states of a type other
    than GDN or with no state split registered, another block size, a head or state split that does not divide,
    another chunk size) is a miss, logged once per pair of worlds with the reason. In-step loads (``places``) are
    never offered for such a hit: they read one rank's entries whole.

Threading
    Event loop.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Container, Sequence
from typing import TYPE_CHECKING

from hkvd.daemon.cache import EntryState
from hkvd.transport.reshard import Move, ShardShape, block_moves, refusal, segments

if TYPE_CHECKING:
    from hkvd.daemon.cache import Cache, Entry, LookupPlan, Tail, WorldFormat
    from hkvd.daemon.engines.registry import EngineState
    from hkvd.daemon.metrics import Metrics
    from hkvd.transport.copy_engine import Segment
    from hkvd.transport.wire import kv

log = logging.getLogger("hkvd.service")

MAX_MOVES_CACHED = 4096  # (source world, reader world, group, rank) move lists kept; past that, all dropped


class Reshards:
    """Cross-TP reads for one daemon (module docstring). ``enabled=False`` (``--tp-reshard off``): none, on this
    node or from peers; every lookup stays in its own world's format, and another TP size's prefix is a miss,
    logged once per pair of worlds."""

    def __init__(self, index: Cache, metrics: Metrics, quarantine: Container[object] = (),
                 enabled: bool = True) -> None:
        self.index = index
        self.metrics = metrics
        self.quarantine = quarantine
        self.enabled = enabled
        self._logged: set[tuple[bytes, bytes]] = set()  # (source world, reader world) refusals logged
        self._moves: dict[tuple[bytes, bytes, int, int], tuple[Move, ...]] = {}

    def sources(self, engine: EngineState) -> list[WorldFormat]:
        """The worlds of ``engine``'s model at other TP sizes whose entries its world can read, most recent first."""
        return self._readable(engine.spec.model, engine.model_key, engine.shard, engine.world_fingerprints)

    def readable(self, world: Sequence[bytes]) -> list[WorldFormat]:
        """``sources`` for the engines of the world ``world`` (every rank's fingerprint), registered or gone: what
        a router's usable-prefix question about that world may count (daemon/routing/usable_prefix.py)."""
        w = self.index.formats.world(world[0]) if world else None
        if w is None:
            return []
        return self._readable(w.model, w.model_key, w.shard, w.fingerprints)

    def _readable(self, model: str, model_key: bytes, shard: ShardShape | None,
                  world: Sequence[bytes]) -> list[WorldFormat]:
        if shard is None or not model_key:
            return []
        if not self.enabled:
            self._log_off(model, model_key, shard, world)
            return []
        out = []
        for w in self.index.formats.same_model(model_key, tuple(world)):
            if set(w.fingerprints) <= set(world):
                continue  # replicated worlds of the model at any TP size: the same entries, read without re-sharding
            why = "it registered no KV-head split" if w.shard is None else refusal(w.shard, shard)
            if why is None:
                out.append(w)
                continue
            pair = (w.fingerprints[0], world[0])
            if pair not in self._logged:
                self._logged.add(pair)
                tp_k = w.shard.world_size if w.shard is not None else len(w.fingerprints)
                log.warning("hkvd: entries of %s stored by a TP=%d engine are not served to a TP=%d engine of the "
                            "same model: %s (a miss; logged once per pair of TP shapes)", model, tp_k,
                            shard.world_size, why)
        return out

    def _log_off(self, model: str, model_key: bytes, shard: ShardShape, world: Sequence[bytes]) -> None:
        """With ``--tp-reshard off``, say once per pair of worlds that another TP size's entries are not read."""
        for w in self.index.formats.same_model(model_key, tuple(world)):
            pair = (w.fingerprints[0], world[0])
            if pair not in self._logged and not set(w.fingerprints) <= set(world):
                self._logged.add(pair)
                log.info("hkvd: entries of %s stored by a TP=%d engine are not served to a TP=%d engine of the same "
                         "model: --tp-reshard off (a miss; logged once per pair of TP shapes)", model,
                         len(w.fingerprints), shard.world_size)

    def plan(self, engine: EngineState, keys: Sequence[bytes], tails: Sequence[Tail], own: LookupPlan,
             seen: bool = False) -> LookupPlan:
        """``own`` (the hit in ``engine``'s world), or a longer hit that every rank of another TP size's world
        holds, to be read re-sharded (``LookupPlan.readers``: one retrieve per rank of ``engine``'s world)."""
        if own.complete or not keys:
            return own
        best = own
        for w in self.sources(engine):
            p = self.index.plan_lookup(engine, keys, w.fingerprints, tails=tails)
            if p.hit_chunks > best.hit_chunks:
                best = dataclasses.replace(p, readers=engine.spec.world_size, missing=own.missing)
        if best is not own:
            self.metrics.inc("tp_reshards", op="lookup")
        return best

    def _block_moves(self, w: WorldFormat, engine: EngineState, group_id: int) -> tuple[Move, ...]:
        key = (w.fingerprints[0], engine.world_fingerprints[0], group_id, engine.spec.rank)
        moves = self._moves.get(key)
        if moves is None:
            assert w.shard is not None and engine.shard is not None
            moves = block_moves(w.shard, engine.shard, group_id, engine.spec.rank)
            if len(self._moves) >= MAX_MOVES_CACHED:
                self._moves.clear()
            self._moves[key] = moves
        return moves

    def read(self, engine: EngineState, msg: kv.Retrieve) -> tuple[list[Entry], list[Segment]] | None:
        """The source entries and copy segments of ``msg`` (a reader rank's retrieve) from the first world of
        another TP size that holds (and, under a lease, leased) every entry it needs; None when none does."""
        lease = self.index.check_lease(msg.lease_id) if msg.lease_id else None
        get, ready = self.index.get, EntryState.READY
        for w in self.sources(engine):
            assert w.shard is not None
            fps = w.fingerprints
            src_groups = {g.group_id: g for g in w.shard.groups}
            entries: list[Entry] = []
            segs: list[Segment] = []
            for it in msg.items:
                moves = self._block_moves(w, engine, it.group_id)
                ranks = sorted({m[1] for m in moves})
                keys = [(fps[r], it.group_id, it.key) for r in ranks]
                if lease is not None and lease.uncovered(keys) is not None:
                    break
                found = [get(k) for k in keys]
                if any(e is None or e.state is not ready for e in found) or any(
                        (k[0], k[1]) in self.quarantine for k in keys):
                    break
                held = [e for e in found if e is not None]
                entries.extend(held)
                segs.extend(segments(engine.groups[it.group_id], it.block_ids, moves,
                                     src_groups[it.group_id].block_bytes,
                                     {r: e.alloc.extents for r, e in zip(ranks, held, strict=True)}))
            else:
                self.metrics.inc("tp_reshards", op="retrieve")
                return entries, segs
        return None
