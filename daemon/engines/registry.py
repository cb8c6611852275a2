"""Registered engines: their specs, layout fingerprints, copy-engine attachments and groups.

An engine rank registers once per connection. A worker connection registers regions and can copy;
a scheduler connection registers the same spec without regions and can only look up. Both get the
same fingerprint, because the fingerprint hashes the *format* of entries (identity, chunk size,
group kinds, block sizes, dtypes, per-view layer counts and page bytes), never addresses or
strides. Registration is refused (``RegistrationError`` naming the smallest ``--l1-size-gb`` that
works) when the pool cannot hold one chunk of the engine: every group's entry, for every rank.
Every registration is recorded in ``formats`` (``hkvd.daemon.cache.Formats``, the cache's one record
of engine formats), which keeps a world's format after its engines leave.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import msgpack

from hkvd.daemon.cache import Formats, GroupRule, HugePagePool, smallest_pool_bytes, superblocks_needed
from hkvd.daemon.engines.client_process import ClientProcess
from hkvd.daemon.engines.validation import validate_hybrid
from hkvd.transport import layout
from hkvd.transport.copy_engine import Attachment, CopyEngine
from hkvd.transport.errors import OutOfRange, RegistrationError
from hkvd.transport.layout import GroupSpec
from hkvd.transport.reshard import HeadSplit, ShardShape
from hkvd.transport.stat_fields import Sample, metric, status_only
from hkvd.transport.state_shards import MambaSplit, StateSplit
from hkvd.transport.wire.control import EngineSpec
from hkvd.transport.wire.kv import Item

FINGERPRINT_VERSION = 2  # 2: the engine identity (weights, dtypes, backend, TP/PP)
SUPPORTED_REGION_KINDS = ("host",)
MIB = 1 << 20
GIB = 1 << 30


def fingerprint(spec: EngineSpec, chunk_size: int) -> bytes:
    """The format of ``spec``'s entries at its own rank (see the module docstring)."""
    return rank_fingerprints(spec, chunk_size, [spec.rank])[0]


def rank_fingerprints(spec: EngineSpec, chunk_size: int, ranks: Iterable[int]) -> tuple[bytes, ...]:
    """The fingerprint of ``spec`` at each rank of ``ranks``: the msgpack of one list, hashed.

    The list's parts other than the rank are packed once, so a 256-rank world costs one pack of
    the groups and 256 hashes, not 256 packs. A world whose every group is replicated
    (``replicated_world``) has one fingerprint for every rank, ``replica_fingerprint``.
    """
    pack = msgpack.Packer(use_bin_type=True).pack
    if replicated_world(spec):
        return (replica_fingerprint(spec, chunk_size),) * len(list(ranks))
    head = b"\x98" + b"".join(pack(x) for x in (FINGERPRINT_VERSION, spec.model, spec.identity, spec.world_size))
    tail = b"".join(pack(x) for x in (spec.layout_tag, chunk_size, [
        [g.group_id, g.kind, g.tokens_per_block, g.window_tokens, g.dtype,
         [[v.num_layers, v.page_bytes] for v in g.views]] for g in spec.groups]))
    start = hashlib.blake2b(head, digest_size=16)
    out = []
    for rank in ranks:
        h = start.copy()
        h.update(pack(rank))
        h.update(tail)
        out.append(h.digest())
    return tuple(out)


def replicated_world(spec: EngineSpec) -> bool:
    """Whether every group of ``spec`` holds the same bytes on every rank (``EngineSpec.replicated``: vLLM's
    MLA latent cache) and the engine named its TP-free model identity: then its entries are stored once per
    node, under ``replica_fingerprint``, and read by every rank of any TP size of the model."""
    return bool(spec.model_identity) and bool(spec.replicated) and (
        {g.group_id for g in spec.groups} <= set(spec.replicated))


def replica_fingerprint(spec: EngineSpec, chunk_size: int) -> bytes:
    """The one fingerprint of a replicated world's entries (``replicated_world``): the format without the TP
    size or the rank (model, ``model_identity``, page order, chunk size, each group's format)."""
    blob = msgpack.packb([FINGERPRINT_VERSION, "replicated", spec.model, spec.model_identity, spec.layout_tag,
                          chunk_size, [[g.group_id, g.kind, g.tokens_per_block, g.window_tokens, g.dtype,
                                        [[v.num_layers, v.page_bytes] for v in g.views]] for g in spec.groups]],
                         use_bin_type=True)
    return hashlib.blake2b(blob, digest_size=16).digest()


def model_key(spec: EngineSpec) -> bytes:
    """The TP-free digest of ``spec``'s model format: model, identity without the TP size
    (``EngineSpec.model_identity``) and page order. Worlds of one model at different TP sizes share it (and
    may read each other's entries: transport/reshard.py); b"" when the engine sent no model identity."""
    if not spec.model_identity:
        return b""
    blob = msgpack.packb([FINGERPRINT_VERSION, "model", spec.model, spec.model_identity, spec.layout_tag],
                         use_bin_type=True)
    return hashlib.blake2b(blob, digest_size=16).digest()


def shard_shape(spec: EngineSpec, chunk_size: int) -> ShardShape:
    """What re-sharding needs of ``spec``'s world (transport/reshard.py)."""
    return ShardShape.of(spec.world_size, chunk_size, spec.layout_tag, spec.groups,
                         {gid: HeadSplit(here, total, states) for gid, here, total, states in spec.heads},
                         {gid: MambaSplit(kind, tuple(StateSplit(axis, totals) for axis, totals in splits))
                          for gid, kind, splits in spec.states})


@dataclass(frozen=True, slots=True)
class EngineGroupStats:
    """One KV-cache group of a registered engine."""

    group_id: int = status_only()
    kind: str = status_only()  # full, swa, mamba
    tokens_per_block: int = status_only()
    window_tokens: int = status_only()
    entry_bytes: int = status_only()


@dataclass(frozen=True, slots=True)
class EngineStats:
    """One registered engine (``hkvd status``: an item of ``engines``)."""

    engine_id: int = status_only()
    pid: int = status_only()
    model: str = status_only()
    rank: int = status_only()
    world_size: int = status_only()
    chunk_size: int = status_only()
    fingerprint: str = status_only()  # hex
    role: str = status_only()  # worker (it registered KV memory: copies) or scheduler (lookups only)
    groups: tuple[EngineGroupStats, ...] = status_only()


def _engines_by_role(engines: tuple[EngineStats, ...], _owner: object) -> list[Sample]:
    roles = {"worker": 0, "scheduler": 0}
    for e in engines:
        roles[e.role] = roles.get(e.role, 0) + 1
    return [({"role": role}, float(n)) for role, n in sorted(roles.items())]


@dataclass(frozen=True, slots=True)
class RegistryStats:
    """The registered engines (``hkvd status``: ``engines``)."""

    engines: tuple[EngineStats, ...] = metric("hkvd_engines", "Registered engines by role", samples=_engines_by_role)


@dataclass(slots=True)
class EngineState:
    engine_id: int
    conn_id: int
    pid: int
    spec: EngineSpec
    chunk_size: int
    fingerprint: bytes
    groups: dict[int, GroupSpec]
    rules: list[GroupRule]
    entry_bytes: dict[int, int]
    kinds: dict[int, str]  # group id -> kind ("full", "swa", "mamba")
    # The fingerprint of each rank of this engine's world (this one's at its own rank): a lookup
    # hits only what every rank holds, and leases every rank's entries.
    rank_fingerprints: tuple[bytes, ...] = ()
    attachment: Attachment | None = None
    stats: dict[str, int] = field(default_factory=dict)
    # The server id of the daemon whose pool this engine's process mapped read-only (Register.mapped_pool):
    # this daemon's when its lookups may name pool extents for this rank (daemon/engines/places.py); "": none.
    mapped_pool: str = ""
    # The TP-free model digest (``model_key``; b"": none) and the world's shape for re-sharding.
    model_key: bytes = b""
    shard: ShardShape | None = None

    @property
    def can_copy(self) -> bool:
        return self.attachment is not None

    @property
    def world_fingerprints(self) -> tuple[bytes, ...]:
        """Every rank's fingerprint (this one's alone where the world's are not known); [0] names the layout."""
        return self.rank_fingerprints or (self.fingerprint,)

    def statistics(self) -> EngineStats:
        return EngineStats(
            engine_id=self.engine_id, pid=self.pid, model=self.spec.model, rank=self.spec.rank,
            world_size=self.spec.world_size, chunk_size=self.chunk_size, fingerprint=self.fingerprint.hex(),
            role="worker" if self.can_copy else "scheduler",
            groups=tuple(EngineGroupStats(group_id=g.group_id, kind=g.kind, tokens_per_block=g.tokens_per_block,
                                          window_tokens=g.window_tokens, entry_bytes=self.entry_bytes[g.group_id])
                         for g in self.groups.values()),
        )

    def check_item(self, item: Item) -> GroupSpec:
        """Bounds-check one item against this engine's registration (never trust the client)."""
        g = self.groups.get(item.group_id)
        if g is None:
            raise OutOfRange(f"group {item.group_id} is not registered by engine {self.engine_id} "
                             f"(registered: {sorted(self.groups)})")
        want = layout.blocks_per_entry(g, self.chunk_size)
        if len(item.block_ids) != want:
            raise OutOfRange(f"group {g.group_id} ({g.kind}) entries take {want} block ids, got "
                             f"{len(item.block_ids)}")
        for b in item.block_ids:
            if b == 0:
                raise OutOfRange(f"group {g.group_id}: block 0 is vLLM's null block and is never copied")
            if not 0 < b < g.num_blocks:
                raise OutOfRange(f"group {g.group_id}: block id {b} is outside [1, {g.num_blocks})")
        return g


class Registry:
    def __init__(self, default_chunk_size: int, copy_engine: CopyEngine, pool: HugePagePool | None = None,
                 formats: Formats | None = None) -> None:
        self.default_chunk_size = default_chunk_size
        self.copy_engine = copy_engine
        self.pool = pool  # registrations whose one chunk it cannot hold are refused; None: not checked
        # Where registrations are recorded (daemon/app.py hands it the cache's); None: a record of its own.
        self.formats = formats if formats is not None else Formats()
        self._engines: dict[int, EngineState] = {}
        self._ids = itertools.count(1)

    def register(self, spec: EngineSpec, process: ClientProcess | int, conn_id: int,
                 mapped_pool: str = "") -> EngineState:
        pid = process if isinstance(process, int) else process.pid
        chunk_size = spec.chunk_size or self.default_chunk_size
        # Every group's format first (a scheduler's registration has no regions to check it against).
        region_sizes = {r.region_id: r.size for r in spec.regions} if spec.regions else None
        for g in spec.groups:
            try:
                g.validate(region_sizes)
            except ValueError as e:
                raise RegistrationError(str(e)) from None  # the message names the group
        validate_hybrid(chunk_size=chunk_size, block_size=spec.block_size or min(
                            g.tokens_per_block for g in spec.groups),
                        max_num_batched_tokens=spec.max_num_batched_tokens,
                        mamba_cache_mode=spec.mamba_cache_mode, groups=spec.groups)
        self._check_pool_holds_chunk(spec, chunk_size)
        for r in spec.regions:
            if r.kind not in (*SUPPORTED_REGION_KINDS, self.copy_engine_kind()):
                raise RegistrationError(
                    f"region {r.region_id} is {r.kind!r} memory, but this daemon runs the "
                    f"{self.copy_engine.name} copy engine; start hkvd serve with the matching engine")
        attachment = self.copy_engine.attach(process, list(spec.regions)) if spec.regions else None
        # Tensor-parallel ranks split heads evenly, so every rank's entries have this rank's format (a
        # replicated world's ranks share one fingerprint: one entry per chunk serves them all).
        rank_fps = rank_fingerprints(spec, chunk_size, range(spec.world_size))
        fp = rank_fps[spec.rank]
        state = EngineState(
            engine_id=next(self._ids), conn_id=conn_id, pid=pid, spec=spec, chunk_size=chunk_size,
            fingerprint=fp, groups={g.group_id: g for g in spec.groups},
            rules=[GroupRule(g.group_id, g.kind, g.window_tokens) for g in spec.groups],  # type: ignore[arg-type]
            entry_bytes={g.group_id: layout.entry_bytes(g, chunk_size) for g in spec.groups},
            kinds={g.group_id: g.kind for g in spec.groups},
            rank_fingerprints=rank_fps,
            attachment=attachment, mapped_pool=mapped_pool,
            model_key=model_key(spec), shard=shard_shape(spec, chunk_size) if spec.model_identity else None,
        )
        self._engines[state.engine_id] = state
        self.formats.add(rank_fps, spec.rank, model=spec.model, chunk_size=chunk_size, rules=state.rules,
                         kinds=state.kinds, entry_bytes=state.entry_bytes, live=True, model_key=state.model_key,
                         shard=state.shard,
                         spec=replace(spec, regions=[], chunk_size=chunk_size) if state.shard else None)
        return state

    def _check_pool_holds_chunk(self, spec: EngineSpec, chunk_size: int) -> None:
        """Refuse an engine whose one chunk (every group's entry, for every rank) the pool cannot hold.

        A store begins every group's entry of a chunk at once, and a hit needs every rank's: with
        less room, every store of this engine would end in PoolFull and no lookup could ever hit.
        """
        pool = self.pool
        if pool is None:
            return
        copies = 1 if replicated_world(spec) else spec.world_size  # a replicated world's chunk is one rank's
        sizes = [layout.entry_bytes(g, chunk_size) for g in spec.groups] * copies
        if pool.allocator.holds(sizes):
            return
        fixed = None if pool.superblocks_auto else pool.allocator.superblock_bytes
        need = smallest_pool_bytes(sizes, fixed, above=pool.size)
        sb = pool.allocator.superblock_bytes
        raise RegistrationError(
            f"the {pool.size / MIB:g} MiB pool cannot hold one chunk of this engine: {chunk_size} tokens are "
            f"{len(sizes)} entries ({len(spec.groups)} groups x {copies} ranks, {sum(sizes) / MIB:.1f} MiB) "
            f"that take {superblocks_needed(sizes, sb)} superblocks of {sb / MIB:g} MiB, and the pool has "
            f"{pool.allocator.num_superblocks}; restart hkvd serve with --l1-size-gb {need / GIB!r} or more "
            "(the smallest pool that holds one chunk), or use a smaller --chunk-size")

    def copy_engine_kind(self) -> str:
        return "cuda" if self.copy_engine.name == "cuda" else "host"

    def unregister(self, engine_id: int) -> None:
        state = self._engines.pop(engine_id, None)
        if state is None:
            return
        self.formats.leave(state.rank_fingerprints)
        if state.attachment is not None:
            self.copy_engine.detach(state.attachment)

    def engines(self) -> list[EngineState]:
        return list(self._engines.values())

    def statistics(self) -> RegistryStats:
        return RegistryStats(tuple(e.statistics() for e in self._engines.values()))
