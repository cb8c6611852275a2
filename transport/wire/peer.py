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
    4. client -> ``PeerAuth(proof_c, fingerprints)``,
       ``proof_c = HMAC-SHA256(token, "hkvd-peer-1 client" || nonce_s || nonce_c)``;
       a wrong proof gets ``Error(PERMISSION)`` and the connection is closed;
    5. server -> ``PeerWelcome(agent, agent_metadata, fingerprints, lease_ttl_s)`` with the layout
       fingerprints both sides serve; none in common gets ``Error(REGISTRATION)`` (layouts differ:
       the daemons refuse to pair) and the connection is closed. The transport metadata, which
       grants access to the serving pool, is sent only here, after both proofs.
    The token itself never crosses the wire.

Requests (after the handshake; ``req_id`` chosen by the client, echoed in the reply)
    ``PeerLookup(req_id, fingerprint, keys, max_chunks, wait_s, release_lease)`` ->
    ``PeerLookupReply(req_id, hit_chunks, lease_id, lease_ttl_s, entries)``: the serving daemon
    applies the hybrid hit rule to ``keys`` (capped at ``max_chunks``), waiting up to ``wait_s`` for
    the hit to reach ``max_chunks`` (Mamba states become visible when their engine confirms them),
    leases the entries that hit needs, releases ``release_lease`` (the producer's hold, if any) and
    lists each entry as ``[group_id, chunk_index, nbytes, [[addr, len], ...]]``: the entry's bytes in
    order, at addresses of its registered pool.
    ``PeerRelease(req_id, lease_id)``: no reply (like ``Release``); an unknown lease is ignored.
    Leases expire on their own after ``lease_ttl_s``; a pulling daemon finishes its READs before
    that or discards what it read.

Engine -> its own daemon
    ``Pull(req_id, peer, keys, max_chunks, release_lease)`` -> ``Done(req_id, nbytes, info)`` with
    ``info = {hit_chunks, lease_id, lease_ttl_s, pulled, local}`` (the lease is on the pulling
    daemon's entries, for the engine's Retrieve), or ``Error(req_id, ...)``: then nothing pulled
    is visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from hkvd.transport.wire import KEY_BYTES, MAX_ITEMS, MAX_KEYS, Message, MsgType, check_u64
from hkvd.transport.wire.errors import ProtocolViolation

PEER_VERSION = 1
NONCE_BYTES = 32
PROOF_BYTES = 32
FINGERPRINT_BYTES = 16
MAX_FINGERPRINTS = 64
MAX_EXTENTS_PER_ENTRY = 1024
MAX_METADATA_BYTES = 8 << 20
MAX_WAIT_S = 30.0
MAX_PEER_ADDRESS = 300


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

    def validate(self) -> None:
        _bytes_of(self.proof, PROOF_BYTES, "PeerAuth.proof")
        _fingerprints(self.fingerprints, "PeerAuth")


@dataclass(frozen=True, slots=True)
class PeerWelcome(Message):
    TYPE = MsgType.PEER_WELCOME
    agent: str
    agent_metadata: bytes
    fingerprints: list[bytes]
    lease_ttl_s: float

    def validate(self) -> None:
        if not self.agent or len(self.agent) > 256:
            raise ProtocolViolation("PeerWelcome.agent: 1..256 characters")
        if len(self.agent_metadata) > MAX_METADATA_BYTES:
            raise ProtocolViolation(f"PeerWelcome.agent_metadata: at most {MAX_METADATA_BYTES} bytes")
        _fingerprints(self.fingerprints, "PeerWelcome")
        if not self.lease_ttl_s > 0:
            raise ProtocolViolation("PeerWelcome.lease_ttl_s must be > 0")


@dataclass(frozen=True, slots=True)
class PeerLookup(Message):
    TYPE = MsgType.PEER_LOOKUP
    req_id: int
    fingerprint: bytes
    keys: list[bytes]
    max_chunks: int
    wait_s: float
    release_lease: int

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
    TYPE = MsgType.PEER_LOOKUP_REPLY
    req_id: int
    hit_chunks: int
    lease_id: int
    lease_ttl_s: float
    entries: list[Any]

    def validate(self) -> None:
        check_u64(self.lease_id, "lease_id")
        if self.hit_chunks < 0:
            raise ProtocolViolation("PeerLookupReply.hit_chunks must be >= 0")
        parse_entries(self.entries)


class RemoteEntry(NamedTuple):
    """One leased entry of the serving daemon: its bytes in order at ``extents`` of the serving pool."""

    group_id: int
    chunk_index: int
    nbytes: int
    extents: list[tuple[int, int]]


def entries_to_wire(entries: list[RemoteEntry]) -> list[list[Any]]:
    return [[e.group_id, e.chunk_index, e.nbytes, [[a, n] for a, n in e.extents]] for e in entries]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_entries(raw: list[Any]) -> list[RemoteEntry]:
    """``[[group_id, chunk_index, nbytes, [[addr, len], ...]], ...]`` -> entries; the extents of an
    entry are non-empty, positive and sum to its ``nbytes``."""
    if len(raw) > MAX_ITEMS:
        raise ProtocolViolation(f"PeerLookupReply: at most {MAX_ITEMS} entries, got {len(raw)}")
    out = []
    for i, e in enumerate(raw):
        where = f"PeerLookupReply.entries[{i}]"
        if not isinstance(e, list) or len(e) != 4 or not all(_int(x) for x in e[:3]) or not isinstance(e[3], list):
            raise ProtocolViolation(f"{where}: an entry is [group_id, chunk_index, nbytes, [[addr, len], ...]]")
        gid, chunk, nbytes, ext = e
        if gid < 0 or chunk < 0 or nbytes <= 0 or not 0 < len(ext) <= MAX_EXTENTS_PER_ENTRY:
            raise ProtocolViolation(f"{where}: group_id and chunk_index >= 0, nbytes > 0, "
                                    f"1..{MAX_EXTENTS_PER_ENTRY} extents")
        extents = []
        for x in ext:
            if not isinstance(x, list) or len(x) != 2 or not all(_int(v) for v in x) or x[0] <= 0 or x[1] <= 0:
                raise ProtocolViolation(f"{where}: an extent is [addr > 0, len > 0]")
            extents.append((x[0], x[1]))
        if sum(n for _, n in extents) != nbytes:
            raise ProtocolViolation(f"{where}: extents hold {sum(n for _, n in extents)} bytes, the entry "
                                    f"has {nbytes}")
        out.append(RemoteEntry(gid, chunk, nbytes, extents))
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
