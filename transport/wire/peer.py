"""Peer messages (types 60-79): daemon-to-daemon pulls, and the engine's request for one.

Roles
    The *serving* daemon (a prefill node's, ``hkvd serve --peer-listen``) answers; the *pulling*
    daemon (a decode node's) connects. Control travels over plain TCP in our frames; the bytes move
    with one-sided READs of the transport (``hkvd.transport.base``), never through this link.

Handshake (every step bounded by the daemon's peer timeout)
    1. the serving daemon checks the connecting address against ``--peer-allow`` before reading a
       byte; a refused address gets ``Error(PERMISSION)`` and the connection is closed;
    2. client -> ``PeerHello(version, node, nonce_c)`` (32 random bytes);
    3. server -> ``PeerChallenge(version, node, nonce_s, proof_s)``,
       ``proof_s = HMAC-SHA256(token, "hkvd-peer-1 server" || nonce_c || nonce_s)``;
       the client checks it, so it never pulls from a daemon that does not know the token;
    4. client -> ``PeerAuth(proof_c, fingerprints[, model_keys])``,
       ``proof_c = HMAC-SHA256(token, "hkvd-peer-1 client" || nonce_s || nonce_c)``;
       a wrong proof gets ``Error(PERMISSION)`` and the connection is closed;
    5. server -> ``PeerWelcome(agent, agent_metadata, fingerprints, lease_ttl_s[, worlds])`` with the
       layout fingerprints both sides serve and, for the ``model_keys`` asked, the serving daemon's worlds
       of those models at other TP sizes (their specs in ``worlds``, their registered ranks' fingerprints
       in ``fingerprints``: a pull across TP sizes); none of either gets ``Error(REGISTRATION)`` (layouts
       differ: the daemons refuse to pair) and the connection is closed. The transport metadata, which
       grants access to the serving pool, is sent only here, after both proofs.
    The token itself never crosses the wire.

Requests (after the handshake; ``req_id`` chosen by the client, echoed in the reply)
    ``PeerLookup(req_id, fingerprint, keys, max_chunks, wait_s, release_lease)`` ->
    ``PeerLookupReply(req_id, hit_chunks, lease_id, lease_ttl_s, entry_table, entry_extents[, entry_checksums])``:
    the serving daemon applies the hybrid hit rule to ``keys`` (capped at ``max_chunks``), waiting up
    to ``wait_s`` for the hit to reach ``max_chunks`` (Mamba states become visible when their engine
    confirms them), leases the entries that hit needs, releases ``release_lease`` (the producer's
    hold, if any) and lists each entry as a row ``group_id, chunk_index, nbytes, n`` of
    ``entry_table`` and its ``n`` extents ``addr, len`` in ``entry_extents`` (both packed
    little-endian uint64): the entry's bytes in order, at addresses of its registered pool; and,
    optionally, each entry's checksum in ``entry_checksums`` (one uint64 per row, 0: none).
    ``PeerRelease(req_id, lease_id)``: no reply (like ``Release``); an unknown lease is ignored.
    Leases expire on their own after ``lease_ttl_s``; a pulling daemon finishes its READs before
    that or discards what it read.

Engine -> its own daemon (on the control socket, under ``PROTOCOL_VERSION``, not ``PEER_VERSION``)
    ``Pull(req_id, peer, keys, max_chunks, release_lease)`` -> ``PullResult(req_id, nbytes, hit_chunks,
    lease_id, lease_ttl_s, pulled, local, seconds[, lookup_s, read_s, descs])`` (the lease is on the pulling
    daemon's entries, for the engine's Retrieve; the READ's timings only when the pull read from the peer),
    or ``Error(req_id, ...)``: then nothing pulled is visible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from hkvd.transport.errors import ProtocolViolation
from hkvd.transport.wire.control import EngineSpec
from hkvd.transport.wire.message import KEY_BYTES, MAX_ITEMS, MAX_KEYS, Message, MsgType, check_u64

# 2: PeerLookupReply carries packed entry arrays; 3: keys with extra keys, engine identity; 4: pulls across TP sizes
# (PeerAuth.model_keys, PeerWelcome.worlds)
PEER_VERSION = 4
NONCE_BYTES = 32
PROOF_BYTES = 32
FINGERPRINT_BYTES = 16
MAX_FINGERPRINTS = 64
MAX_EXTENTS_PER_ENTRY = 1024
MAX_METADATA_BYTES = 8 << 20
MAX_WAIT_S = 30.0
MAX_PEER_ADDRESS = 300
MAX_MODEL_KEYS = 8
MAX_WORLDS_OFFERED = 8  # other TP sizes' worlds of the asked models in one PeerWelcome (the most recent first)


def _bytes_of(value: bytes, n: int, what: str) -> None:
    if len(value) != n:
        raise ProtocolViolation(f"{what} must be {n} bytes, got {len(value)}")


def _fingerprints(fps: list[bytes], what: str) -> None:
    if len(fps) > MAX_FINGERPRINTS:
        raise ProtocolViolation(f"{what}: at most {MAX_FINGERPRINTS} layout fingerprints")
    for fp in fps:
        _bytes_of(fp, FINGERPRINT_BYTES, f"{what}: a layout fingerprint")


def _keys(keys: list[bytes], what: str) -> None:
    if len(keys) > MAX_KEYS:
        raise ProtocolViolation(f"{what}: at most {MAX_KEYS} keys, got {len(keys)}")
    if any(len(k) != KEY_BYTES for k in keys):
        raise ProtocolViolation(f"{what}: every key must be {KEY_BYTES} bytes")


@dataclass(frozen=True, slots=True)
class PeerHello(Message):
    TYPE = MsgType.PEER_HELLO
    version: int
    node: str
    nonce: bytes

    def validate(self) -> None:
        _bytes_of(self.nonce, NONCE_BYTES, "PeerHello.nonce")
        if len(self.node) > 256:
            raise ProtocolViolation("PeerHello.node: at most 256 characters")


@dataclass(frozen=True, slots=True)
class PeerChallenge(Message):
    TYPE = MsgType.PEER_CHALLENGE
    version: int
    node: str
    nonce: bytes
    proof: bytes

    def validate(self) -> None:
        _bytes_of(self.nonce, NONCE_BYTES, "PeerChallenge.nonce")
        _bytes_of(self.proof, PROOF_BYTES, "PeerChallenge.proof")


@dataclass(frozen=True, slots=True)
class PeerAuth(Message):
    TYPE = MsgType.PEER_AUTH
    proof: bytes
    fingerprints: list[bytes]
    # The TP-free model digests of the pulling engines (registry.model_key): the serving daemon offers its
    # worlds of those models at other TP sizes in ``PeerWelcome.worlds``. Empty: the asked layouts only.
    model_keys: list[bytes] = field(default_factory=list)

    def validate(self) -> None:
        _bytes_of(self.proof, PROOF_BYTES, "PeerAuth.proof")
        _fingerprints(self.fingerprints, "PeerAuth")
        if len(self.model_keys) > MAX_MODEL_KEYS:
            raise ProtocolViolation(f"PeerAuth: at most {MAX_MODEL_KEYS} model keys")
        for k in self.model_keys:
            _bytes_of(k, FINGERPRINT_BYTES, "PeerAuth: a model key")


@dataclass(frozen=True, slots=True)
class PeerWelcome(Message):
    TYPE = MsgType.PEER_WELCOME
    agent: str
    agent_metadata: bytes
    fingerprints: list[bytes]
    lease_ttl_s: float
    # Worlds of the models in ``PeerAuth.model_keys`` at other TP sizes, each as the registration that fixed
    # its format (``EngineSpec.to_wire`` without regions): the puller derives their fingerprints and shapes and
    # pulls the ranks it can re-shard (daemon/peers/tp_pulls.py). ``fingerprints`` also lists every rank of
    # these worlds that registered there (the layouts a PeerLookup may name).
    worlds: list[dict[str, Any]] = field(default_factory=list)

    def validate(self) -> None:
        if not self.agent or len(self.agent) > 256:
            raise ProtocolViolation("PeerWelcome.agent: 1..256 characters")
        if len(self.agent_metadata) > MAX_METADATA_BYTES:
            raise ProtocolViolation(f"PeerWelcome.agent_metadata: at most {MAX_METADATA_BYTES} bytes")
        _fingerprints(self.fingerprints, "PeerWelcome")
        if not self.lease_ttl_s > 0:
            raise ProtocolViolation("PeerWelcome.lease_ttl_s must be > 0")
        if len(self.worlds) > MAX_WORLDS_OFFERED:
            raise ProtocolViolation(f"PeerWelcome: at most {MAX_WORLDS_OFFERED} worlds")
        for w in self.worlds:
            spec = EngineSpec.from_wire(w)  # ProtocolViolation names what is wrong
            if spec.regions:
                raise ProtocolViolation("PeerWelcome.worlds: a world's spec carries no regions")

    def specs(self) -> list[EngineSpec]:
        """``worlds``, decoded (checked when the frame was decoded)."""
        return [EngineSpec.from_wire(w) for w in self.worlds]


@dataclass(frozen=True, slots=True)
class PeerLookup(Message):
    TYPE = MsgType.PEER_LOOKUP
    req_id: int
    fingerprint: bytes
    keys: list[bytes]
    max_chunks: int
    wait_s: float
    release_lease: int
    # Optional, trailing: the puller checks checksums, so the reply may carry ``entry_checksums`` (an older
    # puller sends none, and is sent none: it could not parse the field).
    checksums: bool = False

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        _bytes_of(self.fingerprint, FINGERPRINT_BYTES, "PeerLookup.fingerprint")
        _keys(self.keys, "PeerLookup")
        if self.max_chunks < 0:
            raise ProtocolViolation("PeerLookup.max_chunks must be >= 0 (0 = every key)")
        if not 0 <= self.wait_s <= MAX_WAIT_S:
            raise ProtocolViolation(f"PeerLookup.wait_s must be within [0, {MAX_WAIT_S}] seconds")
        check_u64(self.release_lease, "release_lease")


@dataclass(frozen=True, slots=True)
class PeerLookupReply(Message):
    """The leased entries travel as two packed little-endian uint64 arrays (see ``pack_entries``):
    checked in a few vectorised operations, where nested lists cost microseconds per entry."""

    TYPE = MsgType.PEER_LOOKUP_REPLY
    req_id: int
    hit_chunks: int
    lease_id: int
    lease_ttl_s: float
    entry_table: bytes
    entry_extents: bytes
    # Optional, trailing (only to a PeerLookup with ``checksums``; an older daemon sends none): each entry's
    # checksum (XXH3-64 of its bytes; 0: not taken yet), one little-endian uint64 per row of ``entry_table``.
    # The puller checks the bytes it READ against it before it publishes them.
    entry_checksums: bytes = b""

    def validate(self) -> None:
        check_u64(self.lease_id, "lease_id")
        if self.hit_chunks < 0:
            raise ProtocolViolation("PeerLookupReply.hit_chunks must be >= 0")
        check_entries(self.entry_table, self.entry_extents)
        if self.entry_checksums and len(self.entry_checksums) * ENTRY_COLUMNS != len(self.entry_table):
            raise ProtocolViolation("PeerLookupReply.entry_checksums holds one little-endian uint64 per entry, "
                                    f"got {len(self.entry_checksums)} bytes for {len(self.entry_table) // 32} entries")

    def checksums(self) -> list[int]:
        """Each entry's checksum, in entry order (0: none); all 0 when the peer sent none."""
        if not self.entry_checksums:
            return [0] * (len(self.entry_table) // (8 * ENTRY_COLUMNS))
        return np.frombuffer(self.entry_checksums, dtype=_U64).tolist()

    def entries(self) -> list[RemoteEntry]:
        """The entries, in the order the serving daemon listed them (already checked at decode)."""
        return unpack_entries(self.entry_table, self.entry_extents)


class RemoteEntry(NamedTuple):
    """One leased entry of the serving daemon: its bytes in order at ``extents`` of the serving pool."""

    group_id: int
    chunk_index: int
    nbytes: int
    extents: list[tuple[int, int]]


_U64 = np.dtype("<u8")
ENTRY_COLUMNS = 4  # group_id, chunk_index, nbytes, number of extents
MAX_GROUP_ID = 1 << 16
MAX_ENTRY_BYTES = 1 << 40  # far above any entry; keeps every sum below 2**64
MAX_ADDRESS = 1 << 63


def pack_entries(entries: list[RemoteEntry]) -> tuple[bytes, bytes]:
    """``(entry_table, entry_extents)``: one row ``[group_id, chunk_index, nbytes, n]`` per entry,
    then the ``n`` extents ``[addr, len]`` of every entry, in entry order, all little-endian uint64."""
    return pack_table([(e.group_id, e.chunk_index, e.nbytes, len(e.extents)) for e in entries],
                      [x for e in entries for x in e.extents])


def pack_table(table: list[tuple[int, int, int, int]], extents: list[tuple[int, int]]) -> tuple[bytes, bytes]:
    """``pack_entries`` from its rows and its extents (in entry order), for a caller that has them."""
    return (np.array(table, dtype=_U64).reshape(-1, ENTRY_COLUMNS).tobytes(),
            np.array(extents, dtype=_U64).reshape(-1, 2).tobytes())


def pack_checksums(sums: list[int]) -> bytes:
    """``entry_checksums``: one little-endian uint64 per entry, in entry order."""
    return np.array(sums, dtype=_U64).tobytes()


def _arrays(table: bytes, extents: bytes) -> tuple[np.ndarray, np.ndarray]:
    if len(table) % (8 * ENTRY_COLUMNS) or len(extents) % 16:
        raise ProtocolViolation(f"PeerLookupReply: the entry table is rows of {ENTRY_COLUMNS} and the extents "
                                "pairs of little-endian uint64")
    return (np.frombuffer(table, dtype=_U64).reshape(-1, ENTRY_COLUMNS),
            np.frombuffer(extents, dtype=_U64).reshape(-1, 2))


def check_entries(table: bytes, extents: bytes) -> None:
    """Every entry has a small group id, a chunk index within ``MAX_KEYS``, 1..``MAX_EXTENTS_PER_ENTRY``
    extents at non-zero addresses with non-zero lengths, and those lengths sum to its ``nbytes``."""
    rows, ext = _arrays(table, extents)
    if len(rows) > MAX_ITEMS:
        raise ProtocolViolation(f"PeerLookupReply: at most {MAX_ITEMS} entries, got {len(rows)}")
    if not len(rows):
        if len(ext):
            raise ProtocolViolation("PeerLookupReply: extents without entries")
        return
    gid, chunk, nbytes, count = rows.T
    bad = ((gid >= MAX_GROUP_ID) | (chunk >= MAX_KEYS) | (nbytes == 0) | (nbytes > MAX_ENTRY_BYTES)
           | (count == 0) | (count > MAX_EXTENTS_PER_ENTRY))
    if bad.any():
        i = int(np.argmax(bad))
        raise ProtocolViolation(f"PeerLookupReply entry {i}: group_id < {MAX_GROUP_ID}, chunk_index < {MAX_KEYS}, "
                                f"0 < nbytes <= {MAX_ENTRY_BYTES}, 1..{MAX_EXTENTS_PER_ENTRY} extents; got "
                                f"{rows[i].tolist()}")
    if int(count.sum()) != len(ext):
        raise ProtocolViolation(f"PeerLookupReply: the entries name {int(count.sum())} extents, {len(ext)} were sent")
    addr, length = ext.T
    if ((addr == 0) | (addr >= MAX_ADDRESS) | (length == 0) | (length > MAX_ENTRY_BYTES)).any():
        raise ProtocolViolation("PeerLookupReply: an extent is [0 < addr < 2**63, 0 < len <= nbytes]")
    starts = np.cumsum(count) - count
    sums = np.add.reduceat(length, starts.astype(np.intp))
    if (sums != nbytes).any():
        i = int(np.argmax(sums != nbytes))
        raise ProtocolViolation(f"PeerLookupReply entry {i}: extents hold {int(sums[i])} bytes, the entry has "
                                f"{int(nbytes[i])}")


def unpack_entries(table: bytes, extents: bytes) -> list[RemoteEntry]:
    rows, ext = _arrays(table, extents)
    pairs = [(a, n) for a, n in ext.tolist()]
    out, i = [], 0
    for gid, chunk, nbytes, count in rows.tolist():
        out.append(RemoteEntry(gid, chunk, nbytes, pairs[i:i + count]))
        i += count
    return out


@dataclass(frozen=True, slots=True)
class PeerRelease(Message):
    TYPE = MsgType.PEER_RELEASE
    req_id: int
    lease_id: int

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        check_u64(self.lease_id, "lease_id")


@dataclass(frozen=True, slots=True)
class Pull(Message):
    TYPE = MsgType.PULL
    req_id: int
    peer: str
    keys: list[bytes]
    max_chunks: int
    release_lease: int

    def validate(self) -> None:
        check_u64(self.req_id, "req_id")
        if not self.peer or len(self.peer) > MAX_PEER_ADDRESS:
            raise ProtocolViolation(f"Pull.peer must be HOST:PORT (1..{MAX_PEER_ADDRESS} characters)")
        _keys(self.keys, "Pull")
        if not self.keys:
            raise ProtocolViolation("Pull.keys: at least one chunk key")
        if self.max_chunks < 0:
            raise ProtocolViolation("Pull.max_chunks must be >= 0 (0 = every key)")
        check_u64(self.release_lease, "release_lease")


@dataclass(frozen=True, slots=True)
class PullResult(Message):
    TYPE = MsgType.PULL_RESULT
    req_id: int
    nbytes: int  # bytes READ from the peer
    hit_chunks: int
    lease_id: int
    lease_ttl_s: float
    pulled: int  # entries read from the peer
    local: int  # entries this daemon already held
    seconds: float
    lookup_s: float = 0.0  # of ``seconds``: the peer's lookup; 0 (and left out) when nothing had to be read
    read_s: float = 0.0  # of ``seconds``: the transport's READ
    descs: int = 0  # transfer descriptors the READ took
