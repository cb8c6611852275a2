"""Cluster values: their keys, their header, and the fleet key that seals them.

Format (value version 4, key prefix ``hkvd/2/``)
    Key ``hkvd/2/<fingerprint hex>/<group>/<chunk key hex>``: the full index key, so layouts (and the
    engine identities the fingerprint carries) never mix. Value: a 92-byte header, then the payload
    (the entry's bytes in pool order). The header's first 76 bytes are the disk tier's fields
    (``daemon/tiers/disk.py``) under magic ``HKVDCL\\r\\n`` and version 4, where a disk file's CRC-32
    is, here, the *key id* of the fleet key that sealed the value; its last 16 bytes are
    HMAC-SHA256, under that key, of a label, the 76 bytes and the payload (truncated to 16 bytes).

Trust
    Mooncake has no access control: any host that reaches the master can write any key. A value is
    served only when its MAC verifies under a key this node holds: the fleet key
    (``--cluster-key-file``) or, during a key change, the one ``--cluster-accept-key-file`` names.
    Anything else is a miss, counted as ``corrupt{mac}`` and removed. The MAC covers the payload
    itself, not a checksum of it: CRC-32 is linear, so a payload forged to keep a genuine header's
    CRC would pass a MAC of the header alone. HMAC-SHA256 runs at about 1.4 GB/s on one core with
    the SHA extensions (OpenSSL, GIL released), where the CRC-32 it replaces ran at 2.2 GB/s.
    ``--cluster-insecure`` seals with a public key instead: values are checked against damage, and
    anyone on Mooncake's network can write values this node serves.

Key ids
    The first 4 bytes of HMAC-SHA256(key, label + " key id"): a reader picks the key by id, so a
    value under a key it does not hold is refused before its payload is hashed, and accepting two
    keys costs one hash per value. An id tells nothing of its key.

Threading
    ``FleetKeys`` is immutable; the cluster tier swaps the whole object on SIGHUP. Every function is
    safe on any thread; hashing releases the GIL for buffers over 2 KiB.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Callable, Iterable

from hkvd.daemon.cache import EntryKey
from hkvd.daemon.secret_files import MIN_SECRET_BYTES, read_secret
from hkvd.daemon.startup_errors import StartupError
from hkvd.daemon.tiers.disk_format import HEAD_BYTES, HEADER_BYTES, MAC_BYTES, FormatError, Header, parse_head
from hkvd.transport.stat_fields import metric, status_only

MAGIC = b"HKVDCL\r\n"
VERSION = 4  # 4: the MAC covers the payload, under the fleet key, and the header names the key's id
KEY_PREFIX = "hkvd/2/"
_LABEL = b"hkvd-cluster-value-v4 "
PUBLIC_KEY = b"hkvd-cluster-public-key: --cluster-insecure"  # public on purpose: see "Trust"
_GENERATE = "e.g. `openssl rand -hex 32 > /etc/hkvd/cluster.key && chmod 600 /etc/hkvd/cluster.key`"


class ClusterKeyError(StartupError, ValueError):
    """The fleet key is missing, unsafe or too short; the message names the fix."""

    exit_code = 2


def value_key(key: EntryKey) -> str:
    fp, gid, ck = key
    return f"{KEY_PREFIX}{fp.hex()}/{gid}/{ck.hex()}"


def key_id(key: bytes) -> int:
    return int.from_bytes(hmac.digest(key, _LABEL + b"key id", "sha256")[:4], "little")


def read_key(path: str, flag: str) -> bytes:
    """A fleet key file's contents; ``ClusterKeyError`` names what is wrong and the fix."""
    try:
        key = read_secret(path, flag)
    except ValueError as e:
        raise ClusterKeyError(str(e)) from None
    if len(key) < MIN_SECRET_BYTES:
        raise ClusterKeyError(f"{flag} {path} holds {len(key)} bytes; a fleet key is at least {MIN_SECRET_BYTES} "
                              f"random bytes, {_GENERATE}")
    return key


@dataclasses.dataclass(frozen=True, slots=True)
class FleetKeyStats:
    """Which fleet key seals values and which others are accepted (ids only; ``hkvd status``: ``cluster``)."""

    key_id: str = status_only()  # 8 hex digits
    accepted_key_ids: tuple[str, ...] = status_only()
    insecure: bool = metric("hkvd_cluster_insecure", "1 when values are sealed with the public key "
                            "(--cluster-insecure)")


@dataclasses.dataclass(frozen=True, slots=True)
class FleetKeys:
    """The key values are sealed with (``current``) and the keys they are accepted under (it, and ``also``)."""

    current: bytes
    also: tuple[bytes, ...] = ()
    public: bool = False  # --cluster-insecure: ``current`` is PUBLIC_KEY

    @classmethod
    def load(cls, key_file: str, accept_key_file: str = "") -> FleetKeys:
        """The keys ``--cluster-key-file`` and ``--cluster-accept-key-file`` name, or the public key when
        there is no key file (``DaemonConfig`` allows that only with ``--cluster-insecure``). Raises
        ``ClusterKeyError`` naming the fix."""
        if not key_file:
            return cls(PUBLIC_KEY, public=True)
        current = read_key(key_file, "--cluster-key-file")
        also = read_key(accept_key_file, "--cluster-accept-key-file") if accept_key_file else b""
        return cls(current, (also,) if also and also != current else ())

    def ids(self) -> tuple[int, ...]:
        return tuple(key_id(k) for k in (self.current, *self.also))

    def statistics(self) -> FleetKeyStats:
        current, *also = (f"{i:08x}" for i in self.ids())
        return FleetKeyStats(key_id=current, accepted_key_ids=tuple(also), insecure=self.public)

    def seal(self, header: Header, payload: Iterable[memoryview]) -> bytes:
        """The 92-byte header of a value: ``header`` naming the current key, and its MAC with ``payload``."""
        head = dataclasses.replace(header, checksum=key_id(self.current)).pack_head(MAGIC, VERSION)
        return head + _mac(self.current, head, payload)

    def open(self, raw: bytes, payload: Callable[[], Iterable[memoryview]]) -> Header:
        """The header of a value whose 92-byte header is ``raw`` and payload ``payload()``, if a key of
        this node sealed both; else ``FormatError`` (reason: truncated, magic, version, header or mac)."""
        header = parse_head(raw, MAGIC, VERSION)
        key = next((k for k in (self.current, *self.also) if key_id(k) == header.checksum), None)
        if key is None:
            raise FormatError("mac", f"the value was sealed with fleet key {header.checksum:08x}, which this node "
                                     "does not hold (written under another --cluster-key-file, or forged)")
        if not hmac.compare_digest(raw[HEAD_BYTES:HEADER_BYTES], _mac(key, raw[:HEAD_BYTES], payload())):
            raise FormatError("mac", f"the value's MAC does not verify under fleet key {header.checksum:08x} "
                                     "(forged, or damaged)")
        return header


def _mac(key: bytes, head: bytes, payload: Iterable[memoryview]) -> bytes:
    mac = hmac.new(key, _LABEL + head, "sha256")
    for part in payload:
        mac.update(part)
    return mac.digest()[:MAC_BYTES]

