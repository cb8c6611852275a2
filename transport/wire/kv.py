"""KV messages: lookup, store, retrieve, verify, lease watch, abort, errors, lease release, and their replies.

An *item* (``Item``) names one pool entry and the engine blocks it maps to; on the wire
``[group_id, chunk_index, key, block_ids]``, optionally followed by ``parent``, the key of chunk
``chunk_index - 1`` (the daemon uses it to find entries no hit can reach; see docs/design.md).
A leased lookup may also be answered with where its entries lie in the daemon's pool (``LookupReply.places``),
for an engine that mapped the pool and copies them itself (in-step loads).
Stores, retrieves and verifies are jobs: the daemon answers with the job's result (``StoreResult``,
``RetrieveResult``, ``VerifyResult``) or ``Error(req_id)`` when the copies are over. Each reply is declared
beside its request; ``hkvd.transport.wire.replies`` pairs them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.tier_matchers import TIER_BITS
from hkvd.transport.wire.block_notes import BlockNote, check_notes, checked_notes
from hkvd.transport.wire.control import MAX_WORLD_SIZE, check_session, check_tenant
from hkvd.transport.wire.message import KEY_BYTES, MAX_ITEMS, MAX_KEYS, Message, MsgType, check_u64

MAX_BLOCKS_PER_ITEM = 4096
MAX_TAILS = 64  # Lookup.tails: a chunk's positions at the finest prefix_match_unit vLLM takes, and turn ends
MAX_ENDS = 64  # LookupReply.ends
MAX_TURN_END = 1 << 20  # an offset inside a chunk: far above any vLLM block size


class Item(NamedTuple):
    """One pool entry and the engine blocks it maps to; a message's items are ``Item``s, decoded once."""

    group_id: int
    chunk_index: int
    key: bytes
    block_ids: list[int]
    parent: bytes = b""  # key of the previous chunk; b"" for chunk 0 or when the client omits it

    @classmethod
    def decode_list(cls, raw: object, where: str) -> list[Item]:
        return parse_items(raw, where)

    @staticmethod
    def encode_list(records: list[Item]) -> list[list[int | bytes | list[int]]]:
        return items_to_wire(records)


def parse_items(raw: object, where: str) -> list[Item]:
    """The items of ``raw``; ``ProtocolViolation`` naming the first bad one.

    ``type(x) is int`` is exact for msgpack's output: it excludes bools (true/false) and floats.
    """
    if type(raw) is not list or len(raw) > MAX_ITEMS:
        got = f"{len(raw)} items" if isinstance(raw, list) else type(raw).__name__
        raise ProtocolViolation(f"{where}: a list of at most {MAX_ITEMS} items, got {got}")
    items = []
    for i, it in enumerate(raw):
        if type(it) is not list or not 4 <= len(it) <= 5:
            raise ProtocolViolation(f"{where}[{i}]: an item is [group_id, chunk_index, key, block_ids] "
                                    "or [group_id, chunk_index, key, block_ids, parent_key]")
        gid, idx, key, blocks = it[0], it[1], it[2], it[3]
        if type(gid) is not int or type(idx) is not int or idx < 0:
            raise ProtocolViolation(f"{where}[{i}]: group_id and chunk_index must be integers >= 0")
        if type(key) is not bytes or len(key) != KEY_BYTES:
            raise ProtocolViolation(f"{where}[{i}]: key must be {KEY_BYTES} bytes")
        if (type(blocks) is not list or not blocks or len(blocks) > MAX_BLOCKS_PER_ITEM
                or (len(blocks) == 1 and type(blocks[0]) is not int)
                or (len(blocks) > 1 and not all(type(b) is int for b in blocks))):
            raise ProtocolViolation(f"{where}[{i}]: block_ids must be 1..{MAX_BLOCKS_PER_ITEM} integers")
        parent = b""
        if len(it) == 5:
            parent = it[4]
            if type(parent) is not bytes or len(parent) not in (0, KEY_BYTES) or (parent and idx == 0):
                raise ProtocolViolation(f"{where}[{i}]: parent_key must be {KEY_BYTES} bytes (the key of chunk "
                                        "chunk_index - 1), or empty; chunk 0 has no parent")
        items.append(Item(gid, idx, key, blocks, parent))
    return items


def items_to_wire(items: list[Item]) -> list[list[int | bytes | list[int]]]:
    """The arrays ``parse_items`` takes: the parent only when there is one (as a client always sent)."""
    return [[it.group_id, it.chunk_index, it.key, list(it.block_ids), *((it.parent,) if it.parent else ())]
            for it in items]


EVENT_HANDLE_BYTES = 64  # cudaIpcEventHandle_t


def check_event(handle: bytes, where: str) -> None:
    if handle and len(handle) != EVENT_HANDLE_BYTES:
        raise ProtocolViolation(f"{where}: a CUDA IPC event handle is {EVENT_HANDLE_BYTES} bytes (or empty for none)")


@dataclass(frozen=True, slots=True)
class Lookup(Message):
    TYPE = MsgType.LOOKUP
    req_id: int
    keys: list[bytes]
    lease: bool
    # Partial chunks that may end the hit (docs/design.md, "Hit granularity"), each ``[chunk_index, key]``,
    # longest first: a hit of n whole chunks is extended to j + 1 by the first tail whose chunk_index j is
    # at least n and that the daemon serves after chunks [0, j); the reply names it (``LookupReply.tail``).
    # Sent only to a daemon whose RegisterAck.lookup_tails says so.
    tails: list[Any] = field(default_factory=list)
    # Whether the reply names the turn ends the daemon knows where the hit may end (``LookupReply.ends``).
    # Sent only to a daemon whose RegisterAck.turn_ends says so.
    ends: bool = False
    # Whether a leased hit's reply names the pool extents of every entry it loads (``LookupReply.places``), for
    # an engine world whose ranks mapped the daemon's pool (``Register.mapped_pool``). Sent only to a daemon
    # whose RegisterAck.in_step says so.
    places: bool = False
    # The tiers this request's lookup leaves out (``hkvd.transport.tier_matchers``: a bit per tier, its
    # ``kv_load_tiers``); 0: every tier. Sent only to a daemon whose RegisterAck.request_tiers says so.
    skip_tiers: int = 0

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        check_skip_tiers(self.skip_tiers, "Lookup.skip_tiers")
        if type(self.ends) is not bool:
            raise ProtocolViolation("Lookup.ends must be a boolean")
        if type(self.places) is not bool:
            raise ProtocolViolation("Lookup.places must be a boolean")
        if len(self.keys) > MAX_KEYS:
            raise ProtocolViolation(f"Lookup: at most {MAX_KEYS} keys, got {len(self.keys)}")
        if any(len(k) != KEY_BYTES for k in self.keys):
            raise ProtocolViolation(f"Lookup: every key must be {KEY_BYTES} bytes")
        if len(self.tails) > MAX_TAILS:
            raise ProtocolViolation(f"Lookup: at most {MAX_TAILS} tails, got {len(self.tails)}")
        for i, t in enumerate(self.tails):
            if (type(t) is not list or len(t) != 2 or type(t[0]) is not int or not 0 <= t[0] <= len(self.keys)
                    or type(t[1]) is not bytes or len(t[1]) != KEY_BYTES):
                raise ProtocolViolation(f"Lookup.tails[{i}]: a tail is [chunk_index, key], 0 <= chunk_index <= "
                                        f"{len(self.keys)} (the keys sent) and a {KEY_BYTES}-byte key")


@dataclass(frozen=True, slots=True)
class LookupReply(Message):
    TYPE = MsgType.LOOKUP_REPLY
    req_id: int
    hit_chunks: int
    lease_id: int
    lease_ttl_s: float
    # 1 + the index in Lookup.tails of the partial chunk that ends the hit (its last chunk); 0: none did.
    tail: int = 0
    # With Lookup.ends and no tail: ``[chunk_index, offset]`` of the turn ends the daemon knows (stored by any
    # engine, ``Store.turn_end``) inside chunks hit_chunks .. len(Lookup.keys), after the whole chunk
    # chunk_index - 1 of the keys sent; newest first, at most MAX_ENDS. A position only: the client's
    # partial key over its own tokens decides whether it is the same prefix.
    ends: list[Any] = field(default_factory=list)
    # With Lookup.places, a lease, and every rank of the engine's world registered with host memory and the
    # daemon's pool mapped (``Register.mapped_pool``): one list per rank, in rank order, of
    # ``[group_id, chunk_index, extents]`` for each entry the hit loads (chunk_index as in a Retrieve's items:
    # the tail's chunk is the last), ``extents`` the flat ``[offset, length, ...]`` of the entry's bytes in the
    # pool, in order. The lease keeps them from being evicted or rewritten until it is used, released or
    # expires. Empty: load the hit with a Retrieve.
    places: list[Any] = field(default_factory=list)

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        check_places(self.places)
        if type(self.ends) is not list or len(self.ends) > MAX_ENDS:
            raise ProtocolViolation(f"LookupReply: at most {MAX_ENDS} ends, got {len(self.ends)}")
        for i, e in enumerate(self.ends):
            if (type(e) is not list or len(e) != 2 or type(e[0]) is not int or type(e[1]) is not int
                    or not 0 <= e[0] <= MAX_KEYS or not 0 < e[1] < MAX_TURN_END):
                raise ProtocolViolation(f"LookupReply.ends[{i}]: an end is [chunk_index, offset], 0 <= chunk_index "
                                        f"<= {MAX_KEYS}, 0 < offset < {MAX_TURN_END}")


def check_skip_tiers(skip: object, where: str) -> None:
    if type(skip) is not int or not 0 <= skip <= TIER_BITS or skip & ~TIER_BITS:
        raise ProtocolViolation(f"{where}: the bits of the tiers left out, 0 to {TIER_BITS}, got {skip!r:.40}")


def check_places(places: object) -> None:
    """``LookupReply.places``: per rank, ``[group_id, chunk_index, [offset, length, ...]]`` items."""
    if type(places) is not list or len(places) > MAX_WORLD_SIZE:
        raise ProtocolViolation(f"LookupReply.places: a list of at most {MAX_WORLD_SIZE} ranks' places")
    for r, rank in enumerate(places):
        if type(rank) is not list or len(rank) > MAX_ITEMS:
            raise ProtocolViolation(f"LookupReply.places[{r}]: a list of at most {MAX_ITEMS} entries' places")
        for i, p in enumerate(rank):
            if (type(p) is not list or len(p) != 3 or type(p[0]) is not int or type(p[1]) is not int
                    or p[1] < 0 or type(p[2]) is not list or not p[2] or len(p[2]) % 2
                    or not all(type(x) is int and x >= 0 for x in p[2])):
                raise ProtocolViolation(f"LookupReply.places[{r}][{i}]: a place is [group_id, chunk_index, "
                                        "[offset, length, ...]] with at least one extent")


@dataclass(frozen=True, slots=True)
class Store(Message):
    TYPE = MsgType.STORE
    req_id: int
    items: list[Item]  # decoded and checked with the frame (Item.decode_list)
    # IPC handle of the engine's step-end CUDA event: the daemon's stream waits on it before reading
    # (cuda copy engine only; b"" = the blocks are already final, as on the host engine).
    wait_event: bytes = b""
    # vLLM's names of the stored chunks, for KV events (hkvd.transport.wire.block_notes); nil: none.
    # Sent only to a daemon whose RegisterAck.kv_events says it takes them.
    notes: Any = None
    # The tenant whose request stored these chunks (``hkvd.shim.tenants``: "" is the unsalted share);
    # entries are counted against that tenant's quota. Sent only to a daemon whose RegisterAck.pins says so.
    tenant: str = ""
    # A turn-end state (docs/design.md, "Hit granularity"): the offset inside its chunk where the partial
    # chunk these items store ends; the daemon remembers it for other engines' lookups (LookupReply.ends).
    # 0: not a turn end. Sent only to a daemon whose RegisterAck.turn_ends says so.
    turn_end: int = 0
    # The tiers these chunks are not written to (``hkvd.transport.tier_matchers``: a bit per tier, the request's
    # ``kv_store_tiers``); 0: every tier. Sent only to a daemon whose RegisterAck.request_tiers says so.
    skip_tiers: int = 0

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        check_skip_tiers(self.skip_tiers, "Store.skip_tiers")
        if type(self.turn_end) is not int or not 0 <= self.turn_end < MAX_TURN_END:
            raise ProtocolViolation(f"Store.turn_end must be an offset in [0, {MAX_TURN_END})")
        check_event(self.wait_event, "Store.wait_event")
        check_notes(self.notes, "Store.notes")
        check_tenant(self.tenant, "Store.tenant")

    def parsed_notes(self) -> list[BlockNote]:
        return checked_notes(self.notes)


@dataclass(frozen=True, slots=True)
class StoreResult(Message):
    TYPE = MsgType.STORE_RESULT
    req_id: int
    nbytes: int  # bytes copied from the engine's blocks
    stored: int  # entries written
    skipped: int  # entries already cached
    dropped: int  # entries that found no room, counted by the daemon
    thinned: int  # Mamba states left out by --mamba-checkpoint-interval


@dataclass(frozen=True, slots=True)
class Retrieve(Message):
    TYPE = MsgType.RETRIEVE
    req_id: int
    lease_id: int
    items: list[Item]  # decoded and checked with the frame (Item.decode_list)

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        check_u64(self.lease_id, "lease_id")


@dataclass(frozen=True, slots=True)
class RetrieveResult(Message):
    TYPE = MsgType.RETRIEVE_RESULT
    req_id: int
    nbytes: int  # bytes copied into the engine's blocks
    entries: int
    # GPU engines: IPC handle of the CUDA event recorded after the copy (the engine's stream waits on it before
    # a forward reads the blocks); b"": the blocks are written already (host engines).
    event: bytes = b""
    seconds: float = 0.0  # the daemon's time from taking the Retrieve to its reply (0: not measured)

    def validate(self) -> None:
        check_event(self.event, "RetrieveResult.event")


@dataclass(frozen=True, slots=True)
class Verify(Message):
    """A sampled hit, recomputed: the engine computed these chunks instead of loading them, and its blocks
    named by ``items`` now hold them (after ``wait_event`` on GPU engines, as for a ``Store``). The daemon
    reads those blocks through its copy path, compares them with the entries it holds under the same keys
    (per group kind, within a tolerance), and answers a ``VerifyResult``. Nothing is stored; an entry the
    daemon no longer holds is counted as missing, not compared."""

    TYPE = MsgType.VERIFY
    req_id: int
    items: list[Item]  # decoded and checked with the frame (Item.decode_list)
    wait_event: bytes = b""

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        check_event(self.wait_event, "Verify.wait_event")


@dataclass(frozen=True, slots=True)
class VerifyResult(Message):
    TYPE = MsgType.VERIFY_RESULT
    req_id: int
    nbytes: int  # bytes read from the engine's blocks and compared
    checked: int  # entries compared
    diverged: int  # entries past their group kind's tolerance
    missing: int  # entries the daemon no longer held (evicted meanwhile): not compared
    max_error: float  # the largest difference seen, in the tolerance's units (0.0: every byte equal)
    quarantined: bool  # this check put (or kept) the engine's fingerprint and a group in quarantine


MAX_PIN_S = 86400.0


MAX_PIN_PARTIALS = 64  # partial keys one Pin holds: a request's few checkpoints inside blocks and its turn end


@dataclass(frozen=True, slots=True)
class Pin(Message):
    """Hold the chunks ``keys`` (a finished request's chunk keys, in prompt order) of the sending engine
    world against eviction for ``ttl_s`` seconds, as pin ``session`` of ``tenant``. Every group's and every
    rank's entry of those keys is held, in every tier that holds it, whether stored yet or not. A later
    ``Pin`` of the same session supersedes its earlier pins whose keys are a prefix of the new keys; a hit on
    a pinned chunk restarts its session's TTL. Sent by the scheduler only to a daemon whose
    ``RegisterAck.pins`` says it takes pins. No reply (the request does not wait on it).

    ``partial_keys``: keys of partial chunks (states inside a block: a turn's end, vLLM's checkpoints;
    ``hkvd.shim.partial``) held with the pin and ended with it, but left out of the prefix rule (a newer
    turn's keys never continue an older turn's partial key). Sent only to a daemon whose
    ``RegisterAck.pin_partials`` says so."""

    TYPE = MsgType.PIN
    session: str
    tenant: str
    ttl_s: float
    keys: list[bytes]
    partial_keys: list[bytes] = field(default_factory=list)

    def validate(self) -> None:
        check_session(self.session, "Pin.session")
        check_tenant(self.tenant, "Pin.tenant")
        if not 0 < self.ttl_s <= MAX_PIN_S:
            raise ProtocolViolation(f"Pin.ttl_s: a pin lasts more than 0 and at most {MAX_PIN_S:.0f} s, "
                                    f"got {self.ttl_s}")
        if not self.keys or len(self.keys) > MAX_KEYS:
            raise ProtocolViolation(f"Pin: 1 to {MAX_KEYS} keys, got {len(self.keys)}")
        if len(self.partial_keys) > MAX_PIN_PARTIALS:
            raise ProtocolViolation(f"Pin: at most {MAX_PIN_PARTIALS} partial keys, got {len(self.partial_keys)}")
        if any(len(k) != KEY_BYTES for k in (*self.keys, *self.partial_keys)):
            raise ProtocolViolation(f"Pin: every key must be {KEY_BYTES} bytes")


#: The actions a request's ``kv.Hints`` carries (``hkvd.transport.hint_envelope.ACTIONS`` less prefetch, which a
#: request's own lookup does), the outcomes the shim counts, and the bounds.
HINT_ACTIONS = ("share", "demote", "pin", "retain")
HINT_COUNTED_ACTIONS = ("share", "prefetch", "demote", "pin", "retain", "unknown")
HINT_OUTCOMES = ("accepted", "clipped", "deferred", "rejected")
MAX_HINTS = 64
MAX_HINT_TTL_S = 1e9  # asked for; the daemon clips a TTL over MAX_PIN_S (and says so)


@dataclass(frozen=True, slots=True)
class Hints(Message):
    """KV hints a request's ``kv_transfer_params`` carried (docs/hints.md), about that request's chunks ``keys``
    (its chunk keys in prompt order, as stored or found stored when it finished) of the sending engine world,
    for ``tenant``. Action i is ``actions[i]`` with ``ttls_s[i]`` (0: none) and ``sessions[i]`` ("": none).
    ``counted``: hints the shim decided itself, ``"<action>/<outcome>"`` -> how many (refused in parsing, a
    prefetch, the ``pin_s``/``session`` pin sent as ``kv.Pin``), counted with the daemon's. Sent only to a
    daemon whose ``RegisterAck.hints`` says so. No reply."""

    TYPE = MsgType.HINTS
    tenant: str
    keys: list[bytes]
    actions: list[str]
    ttls_s: list[float]
    sessions: list[str]
    counted: dict[str, int] = field(default_factory=dict)

    def validate(self) -> None:
        check_tenant(self.tenant, "Hints.tenant")
        n = len(self.actions)
        if n > MAX_HINTS or len(self.ttls_s) != n or len(self.sessions) != n:
            raise ProtocolViolation(f"Hints: at most {MAX_HINTS} actions, each with one ttl_s and one session "
                                    f"(got {n}, {len(self.ttls_s)}, {len(self.sessions)})")
        if (n and not self.keys) or len(self.keys) > MAX_KEYS or any(len(k) != KEY_BYTES for k in self.keys):
            raise ProtocolViolation(f"Hints: actions need 1 to {MAX_KEYS} keys of {KEY_BYTES} bytes")
        for i, (a, ttl, session) in enumerate(zip(self.actions, self.ttls_s, self.sessions, strict=True)):
            if a not in HINT_ACTIONS:
                raise ProtocolViolation(f"Hints.actions[{i}]: {a[:20]!r} is not one of {', '.join(HINT_ACTIONS)}")
            if not 0 <= ttl <= MAX_HINT_TTL_S:  # NaN fails too
                raise ProtocolViolation(f"Hints.ttls_s[{i}]: 0 (none) to {MAX_HINT_TTL_S:g} s, got {ttl}")
            if session:
                check_session(session, f"Hints.sessions[{i}]")
        if len(self.counted) > len(HINT_COUNTED_ACTIONS) * len(HINT_OUTCOMES):
            raise ProtocolViolation("Hints.counted: one count per action and outcome at most")
        for label, count in self.counted.items():
            action, _, outcome = str(label).partition("/")
            if action not in HINT_COUNTED_ACTIONS or outcome not in HINT_OUTCOMES:
                raise ProtocolViolation(f"Hints.counted: {str(label)[:40]!r} is not \"<action>/<outcome>\"")
            if type(count) is not int or not 0 < count <= MAX_KEYS:
                raise ProtocolViolation(f"Hints.counted[{label!r}]: a count from 1 to {MAX_KEYS}")


@dataclass(frozen=True, slots=True)
class Abort(Message):
    """Drop job ``req_id`` (a store, retrieve, verify, step event or pull of this connection). Answered
    ``AbortAck(req_id)`` at once; the job still ends with its own reply or ``Error`` (``ABORTED``)."""

    TYPE = MsgType.ABORT
    req_id: int


@dataclass(frozen=True, slots=True)
class AbortAck(Message):
    TYPE = MsgType.ABORT_ACK
    req_id: int


@dataclass(frozen=True, slots=True)
class Error(Message):
    TYPE = MsgType.ERROR
    req_id: int
    code: int
    message: str


@dataclass(frozen=True, slots=True)
class Release(Message):
    TYPE = MsgType.RELEASE
    lease_id: int


@dataclass(frozen=True, slots=True)
class WatchLease(Message):
    """Answered ``LeaseWritten(req_id)`` once every rank's Retrieve under ``lease_id`` has written all its bytes
    into the engine's blocks, ``Error(req_id)`` once the lease ends otherwise (a failed or refused retrieve, a
    release, its time to live). Only the connection that took the lease may watch it. A retrieve whose copy the
    engine's stream must still wait for (GPU KV caches: its ``RetrieveResult`` carries an event) never counts
    as written."""

    TYPE = MsgType.WATCH_LEASE
    req_id: int
    lease_id: int

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        check_u64(self.lease_id, "lease_id")


@dataclass(frozen=True, slots=True)
class LeaseWritten(Message):
    TYPE = MsgType.LEASE_WRITTEN
    req_id: int


UNCACHEABLE_REASON_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_")
MAX_REASON = 64


@dataclass(frozen=True, slots=True)
class Uncacheable(Message):
    """The scheduler met a request it cannot key safely: never cached; counted by reason. No reply."""

    TYPE = MsgType.UNCACHEABLE
    reason: str

    def validate(self) -> None:
        if not self.reason or len(self.reason) > MAX_REASON or not set(self.reason) <= UNCACHEABLE_REASON_CHARS:
            raise ProtocolViolation(f"Uncacheable.reason must be 1-{MAX_REASON} characters of [a-z0-9_], "
                                    f"got {self.reason[:80]!r}")
