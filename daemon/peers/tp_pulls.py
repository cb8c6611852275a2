"""Pulls across tensor-parallel sizes: which of a serving daemon's entries a decode rank of another TP size needs.

Role
    A prefill world of TP=k stores its entries per rank; a decode engine of TP=j (j != k) has no layout in
    common with it. The pulling daemon sends its engine's TP-free model digest (``PeerAuth.model_keys``) and the
    serving daemon answers with its worlds of that model at other TP sizes (``PeerWelcome.worlds``: each world's
    registration, without regions). ``TpPulls`` turns one into what the pull needs:
    - the world's format, derived here from the spec as registration derives it (fingerprints of every rank,
      model digest, ``ShardShape``, group rules, entry sizes; never taken on trust), learned into this daemon's
      record of formats (``Formats.learn``), so the local retrieve finds the world and re-shards from it as it
      does on one node (daemon/engines/reshards.py);
    - the source ranks the reader rank needs: those holding its KV heads, each head from the first rank that
      holds it, and its parts of the GDN states (``transport.reshard.block_moves``), each with its ``Layout``
      for the peer lookup and the READ.
    The entries land in this pool under the source world's fingerprints, so a second decode rank that needs
    the same source entries finds them here (``local``) and nothing moves twice.

Refusals
    A world this engine cannot read (``transport.reshard.refusal``: Mamba states not described as GDN's, another
    block size, a head split that does not divide, ...) or ``--tp-reshard off`` on this daemon: the pull is a
    miss (hit 0, the engine recomputes) and one warning per pair of worlds names the reason.

Threading
    Event loop only; pure apart from the record of formats and the refusals already logged.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from hkvd.daemon.cache import Cache, Formats, GroupRule, LookupPlan, WorldFormat
from hkvd.daemon.engines.registry import EngineState, model_key, rank_fingerprints, shard_shape
from hkvd.daemon.peers.layout_book import Layout
from hkvd.transport import layout
from hkvd.transport.reshard import ShardShape, block_moves, refusal
from hkvd.transport.wire.control import EngineSpec

log = logging.getLogger("hkvd.peer_client")

MAX_RANKS_CACHED = 4096  # (source world, reader world, rank) source-rank lists kept; past that, all dropped


@dataclass(frozen=True, slots=True)
class Source:
    """A world of another TP size a reader rank pulls from: the world, the ranks it needs and their layouts."""

    world: WorldFormat
    ranks: tuple[int, ...]
    layouts: tuple[Layout, ...]  # one per rank of ``ranks``

    @property
    def fingerprints(self) -> tuple[bytes, ...]:
        return tuple(lay.fingerprint for lay in self.layouts)


@dataclass(frozen=True, slots=True)
class SpecFormat:
    """The format registration gives a world, derived from its spec."""

    fingerprints: tuple[bytes, ...]
    model_key: bytes
    shard: ShardShape
    rules: tuple[GroupRule, ...]
    kinds: dict[int, str]
    entry_bytes: dict[int, int]

    @classmethod
    def of(cls, spec: EngineSpec) -> SpecFormat:
        """``spec``'s world's format (``spec.chunk_size``: the chunk size the serving daemon chose)."""
        chunk = spec.chunk_size
        return cls(rank_fingerprints(spec, chunk, range(spec.world_size)), model_key(spec), shard_shape(spec, chunk),
                   tuple(GroupRule(g.group_id, g.kind, g.window_tokens) for g in spec.groups),  # type: ignore[arg-type]
                   {g.group_id: g.kind for g in spec.groups},
                   {g.group_id: layout.entry_bytes(g, chunk) for g in spec.groups})


class TpPulls:
    """The pulling side's view of other TP sizes (module docstring)."""

    def __init__(self, formats: Formats, enabled: bool) -> None:
        self.formats = formats
        self.enabled = enabled  # --tp-reshard
        self._logged: set[tuple[bytes, bytes]] = set()  # (source world, reader world) refusals logged
        self._ranks: dict[tuple[bytes, bytes, int], tuple[int, ...]] = {}  # (source, reader world, rank) -> ranks

    @staticmethod
    def wanted(engine: EngineState) -> bool:
        """Whether ``engine``'s model may be pulled from another TP size (it registered a model identity and a
        head split: otherwise its entries are read at its own TP size only)."""
        return bool(engine.model_key) and engine.shard is not None

    def choose(self, engine: EngineState, specs: Sequence[EngineSpec], peer: str) -> Source | None:
        """The first world of ``specs`` (a serving daemon's, the most recent first) that ``engine`` can read
        re-sharded, learned into this daemon's formats; None (logged once per pair of worlds) when none."""
        for spec in specs:
            if spec.chunk_size <= 0 or not spec.model_identity:
                continue
            fmt = SpecFormat.of(spec)
            if fmt.model_key != engine.model_key or engine.shard is None:
                continue  # another model (a peer answers for every model key a link asked about)
            why = "--tp-reshard off" if not self.enabled else refusal(fmt.shard, engine.shard)
            if why is not None:
                self._refused(engine, fmt.fingerprints[0], spec.world_size, peer, why)
                continue
            world = self.formats.learn(fmt.fingerprints, model=spec.model, chunk_size=spec.chunk_size,
                                       rules=fmt.rules, kinds=fmt.kinds, entry_bytes=fmt.entry_bytes,
                                       model_key=fmt.model_key, shard=fmt.shard, spec=spec)
            return self._source(world, engine)
        return None

    def local(self, index: Cache, engine: EngineState, keys: Sequence[bytes], want: int) -> LookupPlan | None:
        """The longest hit of at most ``want`` chunks that ``engine``'s rank can read re-sharded from entries
        already here (pulled for another rank of its world, or stored by an engine of this node), as a plan for
        one reader (``LookupPlan.readers``); None when no world here is readable."""
        if not self.enabled or not self.wanted(engine):
            return None
        best: LookupPlan | None = None
        shard = engine.shard
        assert shard is not None
        for w in self.formats.same_model(engine.model_key, engine.world_fingerprints):
            if w.shard is None or refusal(w.shard, shard) is not None:
                continue
            src = self._source(w, engine)
            p = index.plan_lookup(engine, keys, src.fingerprints, max_chunks=want)
            if best is None or p.hit_chunks > best.hit_chunks:
                best = dataclasses.replace(p, readers=1)
        return best

    def plan(self, index: Cache, engine: EngineState, keys: Sequence[bytes], src: Source, hit: int) -> LookupPlan:
        """The hit of at most ``hit`` chunks that ``src``'s ranks hold here, for one retrieve of ``engine``'s rank."""
        return dataclasses.replace(index.plan_lookup(engine, keys, src.fingerprints, max_chunks=hit), readers=1)

    def _source(self, world: WorldFormat, engine: EngineState) -> Source:
        assert world.shard is not None and engine.shard is not None
        key = (world.fingerprints[0], engine.world_fingerprints[0], engine.spec.rank)
        ranks = self._ranks.get(key)
        if ranks is None:
            ranks = tuple(sorted({m[1] for g in engine.shard.groups
                                  for m in block_moves(world.shard, engine.shard, g.group_id, engine.spec.rank)}))
            if len(self._ranks) >= MAX_RANKS_CACHED:
                self._ranks.clear()
            self._ranks[key] = ranks
        return Source(world, ranks, tuple(Layout.of(world, world.fingerprints[r]) for r in ranks))

    def _refused(self, engine: EngineState, source: bytes, tp_k: int, peer: str, why: str) -> None:
        pair = (source, engine.world_fingerprints[0])
        if pair in self._logged:
            return
        self._logged.add(pair)
        log.warning("hkvd: entries of %s stored by a TP=%d engine on the peer %s are not pulled for a TP=%d engine: "
                    "%s (a miss; logged once per pair of TP shapes)", engine.spec.model, tp_k, peer,
                    engine.spec.world_size, why)
