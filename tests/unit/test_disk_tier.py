"""The disk tier's file format and its writer, scan, read checks and size cap, on a real directory."""

from __future__ import annotations

import asyncio
import os
import stat
import struct
import zlib
from pathlib import Path

import pytest

from hkvd.daemon.cache.pool import Extent
from hkvd.daemon.tiers.disk import DiskTier, DiskTierError
from hkvd.daemon.tiers.disk_format import (
    HEADER_BYTES,
    MAGIC,
    VERSION,
    FormatError,
    Header,
    relative_path,
    unpack_header,
)

FP = bytes(range(16))
ENTRY = 8192
SECRET = b"s" * 32


def header(**kw: object) -> Header:
    base = {"fingerprint": FP, "group_id": 3, "chunk_key": b"k" * 16, "kind": "mamba", "nbytes": ENTRY,
            "checksum": 0xDEADBEEF, "parent": b"p" * 16}
    base.update(kw)
    return Header(**base)  # type: ignore[arg-type]


def test_header_round_trip():
    h = header()
    raw = h.pack(SECRET)
    assert len(raw) == HEADER_BYTES == 92
    assert raw.startswith(MAGIC)
    assert unpack_header(raw, SECRET) == h
    assert unpack_header(header(parent=b"", kind="full").pack(SECRET), SECRET).parent == b""


@pytest.mark.parametrize(("mangle", "reason"), [
    (lambda raw: b"NOTHKVD!" + raw[8:], "magic"),
    (lambda raw: raw[:8] + struct.pack("<H", VERSION + 1) + raw[10:], "version"),
    (lambda raw: raw[:40] + bytes([raw[40] ^ 1]) + raw[41:], "mac"),  # a flipped bit in the fingerprint
    (lambda raw: raw[:50], "truncated"),
    (lambda raw: b"", "truncated"),
])
def test_bad_headers_are_refused_with_a_reason(mangle, reason):
    with pytest.raises(FormatError) as ei:
        unpack_header(mangle(header().pack(SECRET)), SECRET)
    assert ei.value.reason == reason


def test_version_check_comes_before_the_header_mac():
    # A future version may change the layout after the version field: its MAC means nothing to us.
    raw = bytearray(header().pack(SECRET))
    raw[8:10] = struct.pack("<H", 7)
    with pytest.raises(FormatError, match="format version 7") as ei:
        unpack_header(bytes(raw), SECRET)
    assert ei.value.reason == "version"


class Pool:
    """A pool-like buffer: entries are pairs of extents at fixed offsets (split, as the allocator does)."""

    def __init__(self, entries: int) -> None:
        self.mem = bytearray(entries * ENTRY * 2)
        self.buffer = memoryview(self.mem)

    def extents(self, i: int) -> tuple[Extent, ...]:  # two non-adjacent halves
        return (Extent(2 * i * ENTRY, ENTRY // 2), Extent((2 * i + 1) * ENTRY, ENTRY // 2))

    def fill(self, i: int, seed: int) -> bytes:
        data = os.urandom(ENTRY) if seed < 0 else bytes((seed + j) % 251 for j in range(ENTRY))
        (a, la), (b, lb) = self.extents(i)
        self.mem[a:a + la] = data[:la]
        self.mem[b:b + lb] = data[la:]
        return data

    def read(self, i: int) -> bytes:
        return b"".join(bytes(self.mem[o:o + n]) for o, n in self.extents(i))


def key(i: int) -> tuple[bytes, int, bytes]:
    return (FP, 0, i.to_bytes(2, "big") * 8)


async def write_entries(tier: DiskTier, pool: Pool, n: int) -> list[bytes]:
    """Offer n entries and wait until every done callback ran (the caller's unpin)."""
    done = asyncio.Event()
    left = [n]

    def one_done() -> None:
        left[0] -= 1
        if left[0] == 0:
            done.set()

    data = []
    for i in range(n):
        data.append(pool.fill(i, seed=i))
        assert tier.offer(key(i), "full", ENTRY, b"", pool.extents(i), one_done)
    async with asyncio.timeout(20):
        await done.wait()
    return data


def new_tier(root: Path, pool: Pool, cap: int = 1 << 30, **kw: int) -> DiskTier:
    tier = DiskTier(str(root), cap, pool.buffer, queue_bytes=kw.pop("queue_bytes", 1 << 30), **kw)
    tier.open()
    tier.start(asyncio.get_running_loop())
    return tier


async def test_written_entries_survive_a_new_tier_and_read_back_byte_exact(tmp_path):
    pool = Pool(8)
    tier = new_tier(tmp_path, pool)
    data = await write_entries(tier, pool, 4)
    assert tier.statistics().writes == 4 and tier.statistics().entries == 4
    assert not tier.offer(key(0), "full", ENTRY, b"", pool.extents(0), lambda: None)  # already on disk
    assert tier.close(5.0) == 0

    pool2 = Pool(8)
    again = new_tier(tmp_path, pool2)
    assert again.scan.entries == 4
    stored = again.get(key(2))
    assert stored is not None and stored.kind == "full" and stored.nbytes == ENTRY
    assert again.read_batch([(key(2), stored, pool2.extents(5))]) == [None]
    assert pool2.read(5) == data[2]
    again.close(5.0)


async def test_a_flipped_payload_byte_is_caught_at_read_and_the_file_deleted(tmp_path):
    pool = Pool(4)
    tier = new_tier(tmp_path, pool)
    await write_entries(tier, pool, 2)
    tier.close(5.0)
    victim = tmp_path / relative_path(key(1))
    raw = bytearray(victim.read_bytes())
    raw[HEADER_BYTES + 1000] ^= 0x40
    victim.write_bytes(bytes(raw))

    pool2 = Pool(4)
    again = new_tier(tmp_path, pool2)
    assert again.scan.entries == 2  # the header is fine: only the payload CRC can tell
    stored = again.get(key(1))
    assert stored is not None
    [err] = again.read_batch([(key(1), stored, pool2.extents(0))])
    assert isinstance(err, FormatError) and err.reason == "checksum"
    assert key(1) not in again and not victim.exists()
    assert again.statistics().corrupt == {"checksum": 1}
    again.close(5.0)


async def test_scan_skips_counts_and_deletes_unusable_files_and_leaves_others_alone(tmp_path):
    pool = Pool(8)
    tier = new_tier(tmp_path, pool)
    await write_entries(tier, pool, 6)
    tier.close(5.0)
    files = [tmp_path / relative_path(key(i)) for i in range(6)]
    os.truncate(files[0], HEADER_BYTES + 100)  # partial payload
    os.truncate(files[1], 30)  # partial header
    raw = files[2].read_bytes()
    files[2].write_bytes(b"GARBAGE!" + raw[8:])  # bad magic
    raw = bytearray(files[3].read_bytes())
    raw[8:10] = struct.pack("<H", VERSION + 1)  # a newer hkvd's file: skipped, kept
    files[3].write_bytes(bytes(raw))
    files[4].rename(files[4].with_name("0000-0-" + "ab" * 16 + ".hkv"))  # name disagrees with the header
    (tmp_path / "00" / "leftover.hkv.tmp").write_bytes(b"x" * 10)  # a write cut short
    (tmp_path / "00" / "notes.txt").write_text("not ours")
    (tmp_path / "README").write_text("not ours either")

    again = new_tier(tmp_path, Pool(8))
    assert again.scan.entries == 1 and key(5) in again
    assert again.scan.corrupt == {"truncated": 2, "magic": 1, "version": 1, "name": 1}
    assert again.statistics().corrupt == again.scan.corrupt
    assert again.scan.tmp_removed == 1 and again.scan.ignored == 1
    assert not files[0].exists() and not files[1].exists() and not files[2].exists()
    assert files[3].exists()  # another version's file is left in place
    assert (tmp_path / "00" / "notes.txt").exists() and (tmp_path / "README").exists()
    assert not (tmp_path / "00" / "leftover.hkv.tmp").exists()
    again.close(5.0)


async def test_size_cap_evicts_the_least_recently_used_files(tmp_path):
    pool = Pool(8)
    per_file = HEADER_BYTES + ENTRY
    tier = new_tier(tmp_path, pool, cap=3 * per_file)
    await write_entries(tier, pool, 5)
    st = tier.statistics()
    assert st.entries == 3 and st.bytes == 3 * per_file and st.evictions == 2
    assert [key(i) in tier for i in range(5)] == [False, False, True, True, True]
    assert sum(f.endswith(".hkv") for _, _, files in os.walk(tmp_path) for f in files) == 3
    tier.close(5.0)
    # A smaller cap at the next start evicts the oldest at once.
    os.utime(tmp_path / relative_path(key(3)), ns=(1, 1))
    smaller = new_tier(tmp_path, Pool(8), cap=2 * per_file)
    assert smaller.scan.evicted == 1 and key(3) not in smaller and key(2) in smaller and key(4) in smaller
    smaller.close(5.0)


async def test_the_size_cap_passes_over_pinned_files_until_only_pinned_ones_are_left(tmp_path):
    pool = Pool(8)
    per_file = HEADER_BYTES + ENTRY
    tier = new_tier(tmp_path, pool, cap=3 * per_file)
    pinned = {key(0), key(1)}
    tier.held = pinned.__contains__  # the index's pin table (daemon/cache/pins.py)
    await write_entries(tier, pool, 5)  # 0 and 1 are the oldest, and pinned
    assert [key(i) in tier for i in range(5)] == [True, True, False, False, True]
    assert tier.pinned_skips >= 2
    pinned.clear()
    pinned.update(key(i) for i in range(8))  # every file pinned: the cap wins, the oldest go
    done = asyncio.Event()
    pool.fill(5, seed=5)
    assert tier.offer(key(5), "full", ENTRY, b"", pool.extents(5), done.set)
    async with asyncio.timeout(20):
        await done.wait()
    assert [key(i) in tier for i in range(6)] == [False, True, False, False, True, True]
    tier.close(5.0)


def test_a_full_queue_skips_and_counts_instead_of_blocking(tmp_path):
    pool = Pool(4)
    tier = DiskTier(str(tmp_path), 1 << 30, pool.buffer, queue_bytes=ENTRY)  # room for one queued entry
    tier.open()  # writer not started: the queue cannot drain
    assert tier.offer(key(0), "full", ENTRY, b"", pool.extents(0), lambda: None)
    assert not tier.offer(key(1), "full", ENTRY, b"", pool.extents(1), lambda: None)
    assert tier.statistics().queue_drops == 1 and tier.pending() == 1
    assert tier.close(5.0) == 1  # shut down with the queue full: one entry not flushed


async def test_close_reports_entries_it_could_not_flush_and_runs_their_callbacks(tmp_path):
    pool = Pool(4)
    tier = DiskTier(str(tmp_path), 1 << 30, pool.buffer, queue_bytes=1 << 20)
    tier.open()
    ran = []
    for i in range(3):
        assert tier.offer(key(i), "full", ENTRY, b"", pool.extents(i), lambda i=i: ran.append(i))
    tier.start(asyncio.get_running_loop())  # and stop at once: whatever was not taken is not flushed
    left = await asyncio.to_thread(tier.close, 5.0)
    assert left + tier.statistics().writes == 3
    await asyncio.sleep(0.05)
    assert sorted(ran) == [0, 1, 2]


def test_an_unwritable_directory_fails_with_the_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    tier = DiskTier(str(blocker / "l2"), 1 << 30, memoryview(bytearray(16)), queue_bytes=1)
    with pytest.raises(DiskTierError, match=r"--l2-path .*writable directory"):
        tier.open()


def test_write_checksum_is_crc32_of_the_payload_in_pool_order(tmp_path):
    async def run() -> None:
        pool = Pool(2)
        tier = new_tier(tmp_path, pool)
        data = await write_entries(tier, pool, 1)
        tier.close(5.0)
        raw = (tmp_path / relative_path(key(0))).read_bytes()
        h = unpack_header(raw[:HEADER_BYTES], tier.secret)
        assert raw[HEADER_BYTES:] == data[0] and h.checksum == zlib.crc32(data[0]) and h.key == key(0)

    asyncio.run(run())


async def test_version_1_files_of_token_only_keys_are_never_served(tmp_path):
    # Format 1 keyed chunks by their tokens alone (a LoRA, salt or image request could match another's).
    assert VERSION >= 2
    pool = Pool(4)
    tier = new_tier(tmp_path, pool)
    await write_entries(tier, pool, 2)
    tier.close(5.0)
    old = tmp_path / relative_path(key(0))
    raw = bytearray(old.read_bytes())
    raw[8:10] = struct.pack("<H", 1)
    raw[76:80] = struct.pack("<I", zlib.crc32(bytes(raw[:76])))  # a well-formed version-1 header
    old.write_bytes(bytes(raw))

    again = new_tier(tmp_path, Pool(4))
    assert key(0) not in again and key(1) in again
    assert again.scan.corrupt == {"version": 1}
    assert old.exists()  # left for the hkvd version that wrote it
    again.close(5.0)


def test_a_directory_others_may_write_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # like a directory under /tmp
    with pytest.raises(DiskTierError, match="chmod 700"):
        DiskTier(str(shared), 1 << 20, bytearray(4096), queue_bytes=1 << 20).open()
    assert not (shared / "00").exists()  # refused before anything was created in it
    foreign = tmp_path / "foreign"
    foreign.mkdir(mode=0o700)
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)  # another user's directory
        with pytest.raises(DiskTierError, match="owned by uid 65534"):
            DiskTier(str(foreign), 1 << 20, bytearray(4096), queue_bytes=1 << 20).open()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    with pytest.raises(DiskTierError, match="not a directory"):
        DiskTier(str(link), 1 << 20, bytearray(4096), queue_bytes=1 << 20).open()


async def test_a_link_planted_at_a_temporary_name_is_never_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"secret")
    victim.chmod(0o600)
    root = tmp_path / "l2"
    pool = Pool(4)
    tier = new_tier(root, pool)
    # The names a writer used to pick: <name>.hkv.tmp, next to the final file.
    for i in range(2):
        final = root / relative_path(key(i))
        (final.parent / (final.name[: -len(".hkv")] + ".hkv.tmp")).symlink_to(victim)
    await write_entries(tier, pool, 2)
    assert tier.statistics().writes == 2
    assert victim.read_bytes() == b"secret"
    tier.close(5.0)


async def test_files_this_directory_did_not_write_are_never_served(tmp_path):
    pool = Pool(4)
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    tier = new_tier(theirs, pool)
    await write_entries(tier, pool, 2)  # well-formed files, good CRCs, another directory's key
    tier.close(5.0)
    new_tier(mine, Pool(4)).close(5.0)
    for i in range(2):
        dst = mine / relative_path(key(i))
        dst.write_bytes((theirs / relative_path(key(i))).read_bytes())  # planted under the right names
    forged = mine / relative_path(key(2))  # and one forged with a guessed key
    forged.write_bytes(header(chunk_key=key(2)[2], group_id=key(2)[1], kind="full", checksum=zlib.crc32(b"x" * ENTRY),
                              parent=b"").pack(b"\0" * 32) + b"x" * ENTRY)
    again = new_tier(mine, Pool(4))
    assert len(again) == 0 and again.scan.corrupt == {"mac": 3}
    assert not any(f.endswith(".hkv") for _, _, files in os.walk(mine) for f in files)  # deleted
    again.close(5.0)


def test_the_directory_key_must_be_the_daemons_and_private(tmp_path):
    root = tmp_path / "l2"
    DiskTier(str(root), 1 << 20, bytearray(4096), queue_bytes=1 << 20).open()
    key_file = root / "hkvd.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600 and len(key_file.read_bytes()) == 32
    secret = key_file.read_bytes()
    key_file.chmod(0o644)
    with pytest.raises(DiskTierError, match="chmod 600"):
        DiskTier(str(root), 1 << 20, bytearray(4096), queue_bytes=1 << 20).open()
    key_file.unlink()
    elsewhere = tmp_path / "elsewhere.key"
    elsewhere.write_bytes(secret)
    elsewhere.chmod(0o600)
    key_file.symlink_to(elsewhere)
    with pytest.raises(DiskTierError, match="regular file"):
        DiskTier(str(root), 1 << 20, bytearray(4096), queue_bytes=1 << 20).open()
    key_file.unlink()
    key_file.write_bytes(b"short")
    key_file.chmod(0o600)
    with pytest.raises(DiskTierError, match="5 bytes"):
        DiskTier(str(root), 1 << 20, bytearray(4096), queue_bytes=1 << 20).open()
