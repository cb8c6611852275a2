"""The cluster tier's values are served only when a fleet key this node holds sealed them, payload included.

No Mooncake here: the value format, the key files and the start-up refusals. The real cluster (two daemons
in two network namespaces) is tests/cluster/test_cluster.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from hkvd.daemon.config import ConfigError, DaemonConfig
from hkvd.daemon.tiers.cluster_value import ClusterKeyError, FleetKeys, key_id, read_key
from hkvd.daemon.tiers.disk_format import HEADER_BYTES, FormatError, Header
from hkvd.transport.stat_fields import status_dict

A, B, C = b"a" * 32, b"b" * 32, b"c" * 32
HEADER = Header(b"f" * 16, 3, b"k" * 16, "full", 4096, 0, b"p" * 16)


def _payload(seed: int = 1) -> list[memoryview]:
    data = bytes((seed * 7 + i) % 251 for i in range(4096))
    return [memoryview(data[:1000]), memoryview(data[1000:])]  # two extents, as the pool hands them out


def _reason(keys: FleetKeys, raw: bytes, payload: list[memoryview]) -> str:
    """The refusal: its reason, and whether the payload was hashed (the key id named a key held)."""
    with pytest.raises(FormatError) as e:
        keys.open(raw, lambda: payload)
    return e.value.reason + (" (hashed)" if "does not verify" in str(e.value) else "")


def test_a_value_opens_only_under_a_key_that_sealed_it() -> None:
    raw = FleetKeys(A).seal(HEADER, _payload())
    assert len(raw) == HEADER_BYTES
    got = FleetKeys(A).open(raw, _payload)
    assert (got.key, got.kind, got.nbytes, got.parent) == (HEADER.key, "full", 4096, HEADER.parent)
    assert got.checksum == key_id(A)  # the header names the key that sealed it
    assert _reason(FleetKeys(B), raw, _payload()) == "mac"  # another fleet's key: refused before hashing


def test_a_forgery_claiming_the_fleet_key_fails_its_mac() -> None:
    # A forger knows the format and the key id (it is in every genuine value), not the key.
    forged = bytearray(FleetKeys(C).seal(HEADER, _payload(2)))
    forged[24:28] = key_id(A).to_bytes(4, "little")  # the key-id field (a disk file's CRC-32)
    assert _reason(FleetKeys(A), bytes(forged), _payload(2)) == "mac (hashed)"


def test_the_mac_covers_the_payload_not_a_checksum_of_it() -> None:
    # A payload changed so that its CRC-32 stays the same (CRC is linear: four bytes fix it up) is refused.
    raw = FleetKeys(A).seal(HEADER, _payload())
    good = b"".join(bytes(v) for v in _payload())
    bad = bytearray(good)
    bad[:8] = b"poisoned"
    want = zlib.crc32(good)
    bad = _crc_fixup(bad, want)
    assert zlib.crc32(bytes(bad)) == want and bytes(bad) != good
    assert _reason(FleetKeys(A), raw, [memoryview(bytes(bad))]) == "mac (hashed)"
    # One flipped bit in a genuine value, too.
    flipped = bytearray(good)
    flipped[777] ^= 1
    assert _reason(FleetKeys(A), raw, [memoryview(bytes(flipped))]) == "mac (hashed)"


def _crc_fixup(data: bytearray, want: int) -> bytearray:
    """Set the last four bytes of ``data`` so that its CRC-32 is ``want`` (CRC-32 is invertible)."""
    poly = 0xEDB88320
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    top = {t >> 24: i for i, t in enumerate(table)}
    crc = zlib.crc32(bytes(data[:-4])) ^ 0xFFFFFFFF
    target = want ^ 0xFFFFFFFF
    idx = []
    for _ in range(4):  # walk the target back through four table steps
        i = top[target >> 24]
        idx.append(i)
        target = ((target ^ table[i]) << 8) & 0xFFFFFFFF
    out = bytearray(data)
    for k, i in enumerate(reversed(idx)):
        out[-4 + k] = (crc ^ i) & 0xFF
        crc = (crc >> 8) ^ table[(crc ^ out[-4 + k]) & 0xFF]
    return out


def test_a_key_change_accepts_both_keys_and_seals_with_the_current_one() -> None:
    old, new = FleetKeys(A), FleetKeys(B)
    during = FleetKeys(B, (A,))  # step 2 of docs/cluster.md: write the new key, accept the old one
    by_old, by_new = old.seal(HEADER, _payload()), new.seal(HEADER, _payload())
    assert during.open(by_old, _payload).key == HEADER.key and during.open(by_new, _payload).key == HEADER.key
    assert during.seal(HEADER, _payload()) == by_new
    assert FleetKeys(A, (B,)).open(by_new, _payload).key == HEADER.key  # step 1: accepting the next key
    assert _reason(new, by_old, _payload()) == "mac"  # step 3: the old key dropped
    assert status_dict(during.statistics()) == {"key_id": f"{key_id(B):08x}", "accepted_key_ids": [f"{key_id(A):08x}"],
                                                "insecure": False}


def test_key_files_follow_the_secret_file_rules(tmp_path: Path) -> None:
    f = tmp_path / "cluster.key"
    f.write_text("0123456789abcdef0123456789abcdef\n")
    f.chmod(0o600)
    assert read_key(str(f), "--cluster-key-file") == b"0123456789abcdef0123456789abcdef"
    assert FleetKeys.load(str(f), str(f)).also == ()  # the same key twice is one key
    f.chmod(0o640)
    with pytest.raises(ClusterKeyError, match=r"--cluster-key-file .* open to its group .*chmod 600"):
        read_key(str(f), "--cluster-key-file")
    f.chmod(0o600)
    if os.geteuid() == 0:
        os.chown(f, 65534, 65534)
        with pytest.raises(ClusterKeyError, match="owned by uid 65534"):
            read_key(str(f), "--cluster-key-file")
        os.chown(f, 0, 0)
    f.write_text("short\n")
    with pytest.raises(ClusterKeyError, match=r"at least 16 random bytes, e\.g\. `openssl rand -hex 32"):
        read_key(str(f), "--cluster-accept-key-file")
    with pytest.raises(ClusterKeyError, match="No such file"):
        FleetKeys.load(str(tmp_path / "missing"))
    assert FleetKeys.load("").public  # --cluster-insecure: the public key


def test_the_cluster_needs_a_key_file_or_an_explicit_insecure() -> None:
    url = "mooncake://10.0.0.1:50051"
    with pytest.raises(ConfigError, match=r"--cluster-key-file PATH.*--cluster-insecure"):
        DaemonConfig(cluster=url)
    assert DaemonConfig(cluster=url, cluster_insecure=True).cluster_insecure
    with pytest.raises(ConfigError, match="need --cluster"):
        DaemonConfig(cluster_key_file="/etc/hkvd/cluster.key")
    with pytest.raises(ConfigError, match="--cluster-accept-key-file needs --cluster-key-file"):
        DaemonConfig(cluster=url, cluster_insecure=True, cluster_accept_key_file="/etc/hkvd/k")


@pytest.mark.out_of_process
@pytest.mark.parametrize(("extra", "why"), [
    ((), "also set --cluster-key-file PATH"),
    (("--cluster-key-file", "KEY"), "chmod 600"),
])
def test_serve_refuses_the_cluster_without_a_safe_key(tmp_path: Path, extra: tuple[str, ...], why: str) -> None:
    key = tmp_path / "cluster.key"
    key.write_text("0123456789abcdef0123456789abcdef")
    key.chmod(0o644)
    args = [a.replace("KEY", str(key)) for a in extra]
    out = subprocess.run([sys.executable, "-m", "hkvd.daemon", "serve", "--socket", str(tmp_path / "s.sock"),
                          "--cluster", "mooncake://127.0.0.1:1", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert why in out.stderr
