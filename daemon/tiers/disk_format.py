"""The disk tier's file format: the 92-byte header, its MAC, and where an entry's file lies.

The layout is described in ``hkvd.daemon.tiers.disk``; the cluster tier's values share the header
(``hkvd.daemon.tiers.cluster_value``). Pure functions and values: no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

from hkvd.transport.keys import KEY_BYTES

EntryKey = tuple[bytes, int, bytes]  # (fingerprint, group_id, chunk_key), as in daemon/cache/index.py

MAGIC = b"HKVDL2\r\n"
# 2: chunk keys carry the request's extra keys and fingerprints the engine identity (version-1 files
# were written under token-only keys: skipped, counted and left in place, never served).
# 3: the header ends in a MAC under the directory's key instead of a CRC-32.
VERSION = 3
KINDS = ("full", "swa", "mamba")
_HEAD = struct.Struct("<8sHBBIQI16s16s16s")
MAC_BYTES = 16
HEAD_BYTES = _HEAD.size  # 76: the fields a MAC covers
HEADER_BYTES = HEAD_BYTES + MAC_BYTES  # 92
SUFFIX = ".hkv"
TMP_SUFFIX = ".hkv.tmp"
SHARDS = [f"{i:02x}" for i in range(256)]


class FormatError(ValueError):
    """A file is not a valid entry file; ``reason`` is the metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Header:
    fingerprint: bytes
    group_id: int
    chunk_key: bytes
    kind: str
    nbytes: int
    checksum: int
    parent: bytes = b""

    @property
    def key(self) -> EntryKey:
        return (self.fingerprint, self.group_id, self.chunk_key)

    def pack(self, secret: bytes) -> bytes:
        """The 92-byte header of a disk-tier file: the fields, then their MAC under the directory's key."""
        head = self.pack_head()
        return head + _mac(head, secret)

    def pack_head(self, magic: bytes = MAGIC, version: int = VERSION) -> bytes:
        """The 76 bytes before the MAC (cluster values share them: ``daemon/tiers/cluster_value.py``)."""
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if len(self.fingerprint) != 16 or len(self.chunk_key) != KEY_BYTES or len(self.parent) not in (0, KEY_BYTES):
            raise ValueError("fingerprint, chunk key and parent key are 16 bytes (parent may be empty)")
        return _HEAD.pack(magic, version, KINDS.index(self.kind), 0, self.group_id, self.nbytes, self.checksum,
                          self.fingerprint, self.chunk_key, self.parent or bytes(KEY_BYTES))


def _mac(head: bytes, secret: bytes) -> bytes:
    return hashlib.blake2b(head, digest_size=MAC_BYTES, key=secret, person=b"hkvd-l2-header").digest()


def parse_head(raw: bytes | memoryview, magic: bytes = MAGIC, version: int = VERSION) -> Header:
    """The fields of a header (its MAC not checked); raises ``FormatError`` (truncated, magic, version,
    header)."""
    if len(raw) < HEADER_BYTES:
        raise FormatError("truncated", f"{len(raw)} bytes, shorter than the {HEADER_BYTES}-byte header")
    found, found_version, kind, _res, gid, nbytes, checksum, fp, key, parent = _HEAD.unpack(bytes(raw[:HEAD_BYTES]))
    if found != magic:
        raise FormatError("magic", f"not an hkvd {'disk-tier file' if magic == MAGIC else 'value'} (magic {found!r})")
    if found_version != version:
        raise FormatError("version", f"format version {found_version}; this hkvd reads version {version}")
    if kind >= len(KINDS):
        raise FormatError("header", f"unknown entry kind {kind}")
    return Header(fp, gid, key, KINDS[kind], nbytes, checksum, b"" if parent == bytes(KEY_BYTES) else parent)


def unpack_header(raw: bytes | memoryview, secret: bytes) -> Header:
    """Parse and check a disk-tier header; raises ``FormatError`` (reason: truncated, magic, version, mac,
    header)."""
    header = parse_head(raw)
    if not hmac.compare_digest(raw[HEAD_BYTES:HEADER_BYTES], _mac(bytes(raw[:HEAD_BYTES]), secret)):
        raise FormatError("mac", "the header's MAC does not match this directory's key (a file this daemon did "
                                 "not write, or a damaged header)")
    return header


def relative_path(key: EntryKey) -> str:
    fp, gid, ck = key
    return f"{ck[:1].hex()}/{fp.hex()}-{gid}-{ck.hex()}{SUFFIX}"
