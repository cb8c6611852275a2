"""Control messages: hello, registration, status, ping, bye, quarantine lifts and unpins, each request's
reply declared beside it (``hkvd.transport.wire.replies`` pairs them).

``Register`` carries an ``EngineSpec``: the engine's identity, its backing regions and, per
KV-cache group, a table of per-layer views. The spec travels as a msgpack map with explicit keys
(it is sent once per engine rank, so clarity beats compactness here).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hkvd.transport.copy_engine import Region
from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.layout import MAX_PIECES, GroupSpec, View
from hkvd.transport.wire.message import Message, MsgType, check_u64

ROLES = ("scheduler", "worker", "tool", "peer")
REGION_KINDS = ("host", "cuda")
MAX_REGIONS = 256
MAX_GROUPS = 256
MAX_VIEWS = 4096
# Views of all groups together: one per layer tensor of a group; real models have hundreds. Bounds a
# Register frame (~200 KB) and the work it costs the daemon's loop (tens of milliseconds).
MAX_TOTAL_VIEWS = 16384
# Pieces of all views together (a view's page scattered by heads or kernel blocks): bounds a Register
# frame (~1 MB) and the daemon's block templates.
MAX_TOTAL_PIECES = 65536
MAX_IDENTITY = 256
MAX_WORLD_SIZE = 256
MAX_EVENT_KIND = 64
MAX_HEADS = 1 << 16  # EngineSpec.heads: KV heads (on a rank, in the model) and states per page
# EngineSpec.states: per Mamba group, its type's name, at most MAX_STATE_SPLITS states, each split along an axis
# below MAX_STATE_DIMS into at most MAX_STATE_PARTS parts of 1 to MAX_STATE_UNITS units each.
MAX_MAMBA_TYPE = 64
MAX_STATE_SPLITS = 8
MAX_STATE_DIMS = 8
MAX_STATE_PARTS = 8
MAX_STATE_UNITS = 1 << 24
#: EngineSpec.states' item: (group_id, mamba type, ((axis, part totals), ...) one per state).
StateSplits = tuple[int, str, tuple[tuple[int, tuple[int, ...]], ...]]
MAX_SERVER_ID = 64  # Register.mapped_pool: a daemon's server id (HelloAck.server_id, 12 hex digits today)

# RegisterAck.kv_events: what the daemon does with KV-event notes (docs/routing.md). An older daemon
# sends nothing (0): a client then sends no notes, which that daemon would refuse.
KV_EVENTS_UNSUPPORTED = 0
KV_EVENTS_ACCEPTED = 1  # takes notes and answers KVEventsPoll (the connector's path)
KV_EVENTS_PUBLISHED = 2  # also publishes them node-wide (hkvd serve --kv-events-endpoint)


def _get(d: dict[str, object], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in d:
        raise ProtocolViolation(f"{where}: missing key {key!r}")
    value = d[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ProtocolViolation(f"{where}.{key}: wrong type {type(value).__name__}")
    return value


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What an engine rank registers: identity, regions (none for a lookup-only scheduler), groups."""

    model: str
    world_size: int
    rank: int
    layout_tag: str
    chunk_size: int  # tokens; 0 = the daemon's default
    block_size: int  # vLLM's unified block size N
    max_num_batched_tokens: int
    mamba_cache_mode: str
    regions: list[Region] = field(default_factory=list)
    groups: list[GroupSpec] = field(default_factory=list)
    # Digest of what changes the entries' bytes beyond the layout (weights, dtypes, backend, TP/PP:
    # hkvd.shim.identity.engine_identity); part of the daemon's fingerprint. "" for synthetic engines.
    identity: str = ""
    # Per group, how vLLM names it in KV events: (group_id, kv_cache_spec_kind, sliding window or None).
    # Not part of the fingerprint. Empty: derived from the group kinds (docs/routing.md).
    event_groups: list[tuple[int, str, int | None]] = field(default_factory=list)
    # The identity without the tensor-parallel size (hkvd.shim.identity.model_identity): engines of one
    # model at other TP sizes share it, and may read each other's entries (transport/reshard.py).
    # Not part of the fingerprint. "": not offered (an older shim; its entries are read at its TP size only).
    model_identity: str = ""
    # Per attention group: (group_id, KV heads on each rank, KV heads in the model, states per page). Not
    # part of the fingerprint. Empty: no group is re-sharded.
    heads: list[tuple[int, int, int, int]] = field(default_factory=list)
    # Per Mamba group: (group_id, vLLM's Mamba type, per state (axis of the TP split, the model's totals of the
    # parts concatenated along it)); no states: a type not described (transport/state_shards.py). Not part of
    # the fingerprint. Empty: no Mamba group is re-sharded.
    states: list[StateSplits] = field(default_factory=list)
    # The groups whose entries are the same bytes on every rank of the world (vLLM's MLA latent cache: one
    # head, computed from replicated weights). Where they are every group and ``model_identity`` is given, the
    # daemon keys the world's entries by one TP-free fingerprint, so a chunk is stored once per node
    # (docs/design.md, "Replicated groups (MLA)"). Empty: per-rank entries (an older shim's registration too).
    replicated: list[int] = field(default_factory=list)

    def to_wire(self) -> dict[str, object]:
        return {
            "model": self.model, "world_size": self.world_size, "rank": self.rank,
            "layout_tag": self.layout_tag, "chunk_size": self.chunk_size, "block_size": self.block_size,
            "max_num_batched_tokens": self.max_num_batched_tokens, "mamba_cache_mode": self.mamba_cache_mode,
            "identity": self.identity,
            **({"event_groups": [list(g) for g in self.event_groups]} if self.event_groups else {}),
            **({"model_identity": self.model_identity} if self.model_identity else {}),
            **({"heads": [list(h) for h in self.heads]} if self.heads else {}),
            **({"states": [[gid, kind, [[axis, list(totals)] for axis, totals in splits]]
                           for gid, kind, splits in self.states]} if self.states else {}),
            **({"replicated": list(self.replicated)} if self.replicated else {}),
            "regions": [
                {"region_id": r.region_id, "kind": r.kind, "size": r.size, "addr": r.addr,
                 "handle": r.handle, "device_uuid": r.device_uuid, "offset": r.offset}
                for r in self.regions
            ],
            "groups": [
                {"group_id": g.group_id, "kind": g.kind, "tokens_per_block": g.tokens_per_block,
                 "window_tokens": g.window_tokens, "num_blocks": g.num_blocks, "dtype": g.dtype,
                 "views": [[v.region_id, v.offset, v.num_layers, v.layer_stride, v.block_stride, v.page_bytes,
                            *([[list(p) for p in v.pieces]] if v.pieces else [])]
                           for v in g.views]}
                for g in self.groups
            ],
        }

    @classmethod
    def from_wire(cls, d: dict[str, object]) -> EngineSpec:
        w = "EngineSpec"
        regions_raw = _get(d, "regions", list, w)
        groups_raw = _get(d, "groups", list, w)
        if len(regions_raw) > MAX_REGIONS or len(groups_raw) > MAX_GROUPS:
            raise ProtocolViolation(f"{w}: at most {MAX_REGIONS} regions and {MAX_GROUPS} groups")
        regions = []
        for i, r in enumerate(regions_raw):
            rw = f"{w}.regions[{i}]"
            if not isinstance(r, dict):
                raise ProtocolViolation(f"{rw}: expected a map")
            regions.append(Region(
                region_id=_get(r, "region_id", int, rw), kind=_get(r, "kind", str, rw),
                size=_get(r, "size", int, rw), addr=_get(r, "addr", int, rw),
                handle=_get(r, "handle", bytes, rw), device_uuid=_get(r, "device_uuid", str, rw),
                offset=_get(r, "offset", int, rw),
            ))
        groups = []
        total_views = total_pieces = 0
        for i, g in enumerate(groups_raw):
            gw = f"{w}.groups[{i}]"
            if not isinstance(g, dict):
                raise ProtocolViolation(f"{gw}: expected a map")
            views_raw = _get(g, "views", list, gw)
            if len(views_raw) > MAX_VIEWS:
                raise ProtocolViolation(f"{gw}: at most {MAX_VIEWS} views")
            total_views += len(views_raw)
            if total_views > MAX_TOTAL_VIEWS:
                raise ProtocolViolation(f"{w}: at most {MAX_TOTAL_VIEWS} views in all groups together (one per "
                                        "layer tensor of a group); register each KV-cache tensor once")
            views = []
            for j, v in enumerate(views_raw):
                if (not isinstance(v, list) or len(v) not in (6, 7)
                        or not all(isinstance(x, int) and not isinstance(x, bool) for x in v[:6])):
                    raise ProtocolViolation(f"{gw}.views[{j}]: expected 6 integers "
                                            "(region_id, offset, num_layers, layer_stride, block_stride, "
                                            "page_bytes), then optionally its pieces")
                pieces = _pieces(v[6], f"{gw}.views[{j}].pieces") if len(v) == 7 else ()
                total_pieces += len(pieces)
                if total_pieces > MAX_TOTAL_PIECES:
                    raise ProtocolViolation(f"{w}: at most {MAX_TOTAL_PIECES} view pieces in all groups together; "
                                            "register a KV-cache layout that keeps pages whole")
                views.append(View(v[0], v[1], v[2], v[3], v[4], v[5], pieces=pieces))
            groups.append(GroupSpec(
                group_id=_get(g, "group_id", int, gw), kind=_get(g, "kind", str, gw),
                tokens_per_block=_get(g, "tokens_per_block", int, gw),
                window_tokens=_get(g, "window_tokens", int, gw), num_blocks=_get(g, "num_blocks", int, gw),
                dtype=_get(g, "dtype", str, gw), views=tuple(views),
            ))
        spec = cls(
            model=_get(d, "model", str, w), world_size=_get(d, "world_size", int, w),
            rank=_get(d, "rank", int, w), layout_tag=_get(d, "layout_tag", str, w),
            chunk_size=_get(d, "chunk_size", int, w), block_size=_get(d, "block_size", int, w),
            max_num_batched_tokens=_get(d, "max_num_batched_tokens", int, w),
            mamba_cache_mode=_get(d, "mamba_cache_mode", str, w), regions=regions, groups=groups,
            identity=_get(d, "identity", str, w),
            event_groups=_event_groups(d.get("event_groups"), len(groups_raw), f"{w}.event_groups"),
            model_identity=_model_identity(d.get("model_identity"), f"{w}.model_identity"),
            heads=_heads(d.get("heads"), len(groups_raw), f"{w}.heads"),
            states=_states(d.get("states"), len(groups_raw), f"{w}.states"),
            replicated=_replicated(d.get("replicated"), len(groups_raw), f"{w}.replicated"),
        )
        spec.validate_shape()
        return spec

    def validate_shape(self) -> None:
        """Value checks that need no daemon state (bounds against regions happen in the registry)."""
        if not 1 <= self.world_size <= MAX_WORLD_SIZE or not 0 <= self.rank < self.world_size:
            raise ProtocolViolation(f"rank {self.rank} is outside world_size {self.world_size} "
                                    f"(at most {MAX_WORLD_SIZE} ranks)")
        if self.chunk_size < 0 or self.block_size < 0 or self.max_num_batched_tokens < 0:
            raise ProtocolViolation("chunk_size, block_size and max_num_batched_tokens must be >= 0")
        ids = [r.region_id for r in self.regions]
        if len(set(ids)) != len(ids):
            raise ProtocolViolation("region ids must be unique")
        for r in self.regions:
            if r.kind not in REGION_KINDS:
                raise ProtocolViolation(f"region {r.region_id}: kind {r.kind!r} is not one of {REGION_KINDS}")
            if r.size <= 0 or r.addr < 0 or r.offset < 0:
                raise ProtocolViolation(f"region {r.region_id}: size must be > 0, addr and offset >= 0")
        gids = [g.group_id for g in self.groups]
        if len(set(gids)) != len(gids):
            raise ProtocolViolation("group ids must be unique")
        if not self.groups:
            raise ProtocolViolation("an engine must register at least one KV-cache group")
        if len(self.identity) > MAX_IDENTITY:
            raise ProtocolViolation(f"identity: at most {MAX_IDENTITY} characters")
        if self.event_groups and sorted(g[0] for g in self.event_groups) != sorted(gids):
            raise ProtocolViolation("event_groups must name each registered group once")
        if len(self.model_identity) > MAX_IDENTITY:
            raise ProtocolViolation(f"model_identity: at most {MAX_IDENTITY} characters")
        hgids = [h[0] for h in self.heads]
        if len(set(hgids)) != len(hgids) or not set(hgids) <= set(gids):
            raise ProtocolViolation("heads must name registered groups, each at most once")
        sgids = [st[0] for st in self.states]
        if len(set(sgids)) != len(sgids) or not set(sgids) <= {g.group_id for g in self.groups if g.kind == "mamba"}:
            raise ProtocolViolation("states must name registered Mamba groups, each at most once")
        if len(set(self.replicated)) != len(self.replicated) or not set(self.replicated) <= set(gids):
            raise ProtocolViolation("replicated must name registered groups, each at most once")


def _pieces(raw: object, where: str) -> tuple[tuple[int, int], ...]:
    """A view's pieces: 1 to ``MAX_PIECES`` [offset, bytes] pairs (their values: ``GroupSpec.validate``)."""
    if not isinstance(raw, list) or not 0 < len(raw) <= MAX_PIECES:
        raise ProtocolViolation(f"{where}: a list of 1 to {MAX_PIECES} [offset, bytes] pairs")
    out = []
    for i, p in enumerate(raw):
        if not isinstance(p, list) or len(p) != 2 or type(p[0]) is not int or type(p[1]) is not int:
            raise ProtocolViolation(f"{where}[{i}]: expected [offset from the page start, bytes]")
        out.append((p[0], p[1]))
    return tuple(out)


def _model_identity(raw: object, where: str) -> str:
    """Optional; absent from older clients."""
    if raw is None:
        return ""
    if type(raw) is not str or len(raw) > MAX_IDENTITY:
        raise ProtocolViolation(f"{where}: a string of at most {MAX_IDENTITY} characters")
    return raw


def _heads(raw: object, n_groups: int, where: str) -> list[tuple[int, int, int, int]]:
    """Optional; absent from older clients: at most one [group_id, heads here, heads in all, states] per group."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > n_groups:
        raise ProtocolViolation(f"{where}: a list of at most one [group_id, heads here, heads in all, states] "
                                "per group")
    out: list[tuple[int, int, int, int]] = []
    for i, h in enumerate(raw):
        if (not isinstance(h, list) or len(h) != 4 or not all(type(x) is int for x in h)
                or h[0] < 0 or not all(1 <= x <= MAX_HEADS for x in h[1:])):
            raise ProtocolViolation(f"{where}[{i}]: expected [group_id >= 0, heads on a rank, heads in the model, "
                                    f"states per page], each 1 to {MAX_HEADS}")
        out.append((h[0], h[1], h[2], h[3]))
    return out


def _states(raw: object, n_groups: int, where: str) -> list[StateSplits]:
    """Optional; absent from older clients: at most one [group_id, mamba type, [[axis, [part totals]], ...]] per
    group (bounds: the MAX_STATE_* constants)."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > n_groups:
        raise ProtocolViolation(f"{where}: a list of at most one [group_id, mamba type, state splits] per group")
    out: list[StateSplits] = []
    for i, st in enumerate(raw):
        if (not isinstance(st, list) or len(st) != 3 or type(st[0]) is not int or st[0] < 0
                or not isinstance(st[1], str) or not 0 < len(st[1]) <= MAX_MAMBA_TYPE
                or not isinstance(st[2], list) or len(st[2]) > MAX_STATE_SPLITS):
            raise ProtocolViolation(f"{where}[{i}]: expected [group_id >= 0, mamba type (1 to {MAX_MAMBA_TYPE} "
                                    f"characters), at most {MAX_STATE_SPLITS} state splits]")
        splits = []
        for j, sp in enumerate(st[2]):
            if (not isinstance(sp, list) or len(sp) != 2 or type(sp[0]) is not int
                    or not 0 <= sp[0] < MAX_STATE_DIMS or not isinstance(sp[1], list)
                    or not 0 < len(sp[1]) <= MAX_STATE_PARTS
                    or not all(type(t) is int and 1 <= t <= MAX_STATE_UNITS for t in sp[1])):
                raise ProtocolViolation(f"{where}[{i}][2][{j}]: expected [axis 0 to {MAX_STATE_DIMS - 1}, 1 to "
                                        f"{MAX_STATE_PARTS} part totals, each 1 to {MAX_STATE_UNITS}]")
            splits.append((sp[0], tuple(sp[1])))
        out.append((st[0], st[1], tuple(splits)))
    return out


def _replicated(raw: object, n_groups: int, where: str) -> list[int]:
    """Optional; absent from older clients: at most one group id per group."""
    if raw is None:
        return []
    if (not isinstance(raw, list) or len(raw) > n_groups
            or not all(type(g) is int and g >= 0 for g in raw)):
        raise ProtocolViolation(f"{where}: a list of at most one group id (>= 0) per group")
    return list(raw)


def _event_groups(raw: object, n_groups: int, where: str) -> list[tuple[int, str, int | None]]:
    """Optional; absent from older clients."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > n_groups:
        raise ProtocolViolation(f"{where}: a list of at most one [group_id, kind, sliding_window] per group")
    out: list[tuple[int, str, int | None]] = []
    for i, g in enumerate(raw):
        if (not isinstance(g, list) or len(g) != 3 or type(g[0]) is not int or type(g[1]) is not str
                or not 0 < len(g[1]) <= MAX_EVENT_KIND or not (g[2] is None or (type(g[2]) is int and g[2] >= 0))):
            raise ProtocolViolation(f"{where}[{i}]: expected [group_id, kind (1-{MAX_EVENT_KIND} characters), "
                                    "sliding window (tokens) or nil]")
        out.append((g[0], g[1], g[2]))
    return out


@dataclass(frozen=True, slots=True)
class Hello(Message):
    TYPE = MsgType.HELLO
    version: int
    client_name: str
    role: str

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ProtocolViolation(f"Hello.role must be one of {ROLES}, got {self.role!r}")


@dataclass(frozen=True, slots=True)
class HelloAck(Message):
    TYPE = MsgType.HELLO_ACK
    version: int
    daemon_pid: int
    max_frame_bytes: int
    server_id: str
    # To an engine (a worker or scheduler connection) of a daemon that offers in-step loads
    # (--in-step-loads): ``[fd, size]``, the pool memfd's number in the daemon process and the pool's mapped
    # size in bytes. The engine may open ``/proc/<daemon_pid>/fd/<fd>`` read-only, map ``size`` bytes, and
    # then name ``server_id`` in ``Register.mapped_pool``. Empty: not offered (an older daemon sends nothing).
    pool: list[Any] = field(default_factory=list)

    def validate(self) -> None:
        if type(self.pool) is not list or (self.pool and (
                len(self.pool) != 2 or not all(type(x) is int for x in self.pool)
                or self.pool[0] < 0 or self.pool[1] <= 0)):
            raise ProtocolViolation("HelloAck.pool: [fd >= 0, size > 0] of the daemon's pool, or empty")


@dataclass(frozen=True, slots=True)
class Register(Message):
    TYPE = MsgType.REGISTER
    req_id: int
    spec: dict[str, Any]
    # The server id (HelloAck.server_id) of the daemon whose pool this engine process mapped read-only
    # (HelloAck.pool): that daemon's lookups with ``places`` may then name pool extents for this engine's
    # rank. "": none mapped. Sent only to a daemon that offered its pool.
    mapped_pool: str = ""

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        if type(self.mapped_pool) is not str or len(self.mapped_pool) > MAX_SERVER_ID:
            raise ProtocolViolation(f"Register.mapped_pool: a server id of at most {MAX_SERVER_ID} characters, "
                                    "or empty")

    def engine_spec(self) -> EngineSpec:
        return EngineSpec.from_wire(self.spec)


@dataclass(frozen=True, slots=True)
class RegisterAck(Message):
    TYPE = MsgType.REGISTER_ACK
    req_id: int
    engine_id: int
    fingerprint: bytes
    chunk_size: int
    kv_events: int = KV_EVENTS_UNSUPPORTED  # KV_EVENTS_*: whether to send notes, and poll
    # Whether it answers WatchLease (an older daemon sends nothing: False, and a client sends none).
    lease_watch: bool = False
    # Whether it compares sampled hits (kv.Verify, StepEvent.verifies); an older daemon sends nothing: False,
    # and a client samples none (an unknown message would fail the connection's every request).
    verify: bool = False
    # Whether it takes kv.Pin and Store.tenant (session pins, tenant quotas); an older daemon sends
    # nothing: False, and a client sends neither.
    pins: bool = False
    # Whether it takes kv.Pin.partial_keys; an older daemon sends nothing: False, and a client pins whole
    # chunks only.
    pin_partials: bool = False
    # Whether it takes StepEvent.tenants (the tenant of each Mamba state offered); an older daemon sends
    # nothing: False, and a client sends none (every offered state then counts as the unsalted share's).
    step_tenants: bool = False
    # Whether it takes Lookup.tails (partial chunks tried in the same lookup); an older daemon sends nothing:
    # False, and a client probes them with lookups of their own once the whole-chunk answer is in.
    lookup_tails: bool = False
    # Whether it takes a partial chunk's note (``block_notes.is_partial``); an older daemon sends nothing:
    # False, and a client sends partial chunks without notes (no event names them).
    partial_notes: bool = False
    # Whether it takes Store.turn_end and Lookup.ends (turn ends other engines stored); an older daemon sends
    # nothing: False, and a client finds only the turn ends it remembers itself.
    turn_ends: bool = False
    # Whether it answers Lookup.places (in-step loads: --in-step-loads on); an older daemon, or one with the
    # option off, sends nothing: False, and a client asks for no places (every hit is a Retrieve).
    in_step: bool = False
    # Whether it takes kv.Hints (a request's KV hints, docs/hints.md); an older daemon sends nothing: False, and
    # a client sends none (the hints are counted as rejected by the shim).
    hints: bool = False
    # Whether it takes Lookup.skip_tiers and Store.skip_tiers (a request's load and store tiers, docs/hints.md); an
    # older daemon sends nothing: False, and a client sends neither (its requests use every tier).
    request_tiers: bool = False

    def validate(self) -> None:
        if type(self.request_tiers) is not bool:
            raise ProtocolViolation("RegisterAck.request_tiers must be a boolean")
        if type(self.in_step) is not bool:
            raise ProtocolViolation("RegisterAck.in_step must be a boolean")
        if type(self.hints) is not bool:
            raise ProtocolViolation("RegisterAck.hints must be a boolean")


@dataclass(frozen=True, slots=True)
class Unregister(Message):
    """End the connection's engine registration; its leases and pending work are released. Answered
    ``Unregistered``."""

    TYPE = MsgType.UNREGISTER
    req_id: int


@dataclass(frozen=True, slots=True)
class Unregistered(Message):
    TYPE = MsgType.UNREGISTERED
    req_id: int


@dataclass(frozen=True, slots=True)
class Bye(Message):
    TYPE = MsgType.BYE
    reason: str


@dataclass(frozen=True, slots=True)
class Status(Message):
    TYPE = MsgType.STATUS
    req_id: int


@dataclass(frozen=True, slots=True)
class StatusReply(Message):
    TYPE = MsgType.STATUS_REPLY
    req_id: int
    status: dict[str, Any]


_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class LiftQuarantine(Message):
    """Serve again the entries of every quarantined group of the layout fingerprints that start with
    ``fingerprint`` (at least 8 hex digits; ``all``: every quarantine). ``hkvd quarantine --clear``
    sends it; answered ``QuarantineLifted``."""

    TYPE = MsgType.LIFT_QUARANTINE
    req_id: int
    fingerprint: str

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        fp = self.fingerprint
        if fp != "all" and not (8 <= len(fp) <= 32 and set(fp) <= _HEX):
            raise ProtocolViolation(f"LiftQuarantine.fingerprint: 8 to 32 lowercase hex digits of a layout "
                                    f"fingerprint (hkvd status shows them), or all; got {fp[:40]!r}")


@dataclass(frozen=True, slots=True)
class QuarantineLifted(Message):
    TYPE = MsgType.QUARANTINE_LIFTED
    req_id: int
    lifted: str  # the pairs lifted, "fingerprint/group" comma-separated; empty: none matched


@dataclass(frozen=True, slots=True)
class Unpin(Message):
    """End every pin of ``session`` (``hkvd unpin SESSION``, or a router that knows a session ended); its
    entries go back to plain eviction order. Answered ``Unpinned``."""

    TYPE = MsgType.UNPIN
    req_id: int
    session: str

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        check_session(self.session, "Unpin.session")


@dataclass(frozen=True, slots=True)
class Unpinned(Message):
    TYPE = MsgType.UNPINNED
    req_id: int
    unpinned: int  # the session's pins ended (0 for a session the daemon does not know: not an error)


MAX_SESSION = 128
MAX_TENANT = 64


def check_session(session: str, where: str) -> None:
    """A session id: 1 to ``MAX_SESSION`` printable ASCII characters without spaces."""
    if not 1 <= len(session) <= MAX_SESSION or not all("!" <= c <= "~" for c in session):
        raise ProtocolViolation(f"{where}: a session id is 1 to {MAX_SESSION} printable ASCII characters "
                                f"without spaces, got {session[:40]!r}")


def check_tenant(tenant: str, where: str) -> None:
    """A tenant label: empty (the unsalted share) or up to ``MAX_TENANT`` printable ASCII characters."""
    if len(tenant) > MAX_TENANT or not all("!" <= c <= "~" for c in tenant):
        raise ProtocolViolation(f"{where}: a tenant label is at most {MAX_TENANT} printable ASCII characters "
                                f"without spaces, got {tenant[:40]!r}")


@dataclass(frozen=True, slots=True)
class Ping(Message):
    TYPE = MsgType.PING
    req_id: int


@dataclass(frozen=True, slots=True)
class Pong(Message):
    TYPE = MsgType.PONG
    req_id: int
