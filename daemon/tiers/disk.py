"""Cold-restart disk tier (``--l2-path``): a write-behind copy of READY entries, read back on lookups.

Role
    Keeps a second copy of cached entries on local disk so that a restarted daemon (``systemctl
    restart``, an upgrade, a crash) serves hits at once instead of starting cold. Copies to and from
    engines only ever touch the pool (L1); this module moves bytes between pool pages and files:

    - write-behind: the service offers each entry when it becomes READY (stores; Mamba states only
      once their engine confirmed them). A bounded queue feeds one writer thread; a full queue skips
      the entry and counts it (``queue_drops``): a slow disk never fails or slows a store.
    - read: a lookup whose hit needs entries found only here has them read into fresh pool entries,
      checksummed, before it replies (``KVService._promote``).
    - catalog: key -> file, in memory, rebuilt at start-up from every file's header.

File format (version 3): one file per entry, ``<dir>/<kk>/<fingerprint>-<group>-<key>.hkv`` (kk: the
chunk key's first byte in hex, 256 subdirectories). A 92-byte little-endian header: magic
``HKVDL2\\r\\n``, u16 format version, u8 kind (0 full, 1 swa, 2 mamba), u8 reserved (0), u32 group
id, u64 payload bytes, u32 CRC-32 of the payload, 16-byte layout fingerprint, 16-byte chunk key,
16-byte parent chunk key (zeros: unknown), then a 16-byte MAC of the 76 header bytes before it
(keyed blake2b); then the payload: the entry's bytes in pool order.

The MAC's key is the directory's secret, ``<dir>/hkvd.key`` (32 random bytes, mode 0600, made on
first use). A file this directory's daemon did not write (planted, or copied from another node's
tier) fails it and is deleted, never served; since the MAC covers the payload's CRC, its bytes are
bound too, as far as CRC-32 binds them. CRC-32 (zlib, ~4 GB/s on one core here, GIL released)
rather than a keyed hash of the payload (blake2b ~0.7 GB/s): whoever can rewrite a file in the
directory is the daemon's own user, who can read the key as well.

Durability (fsync policy)
    A file is written under an unpredictable ``<name>.<random>.hkv.tmp`` (created with ``O_EXCL |
    O_NOFOLLOW``) and renamed over ``<name>``: a scan or a read never sees a
    half-written file under its final name. Nothing is fsynced: this is a cache. A restart of the
    daemon reads back everything that was renamed (the page cache outlives the process); a clean
    reboot syncs file systems; after a power loss, a file whose data never reached the disk fails
    its size check at start-up or its payload CRC at read, and is a miss.

Checks
    At start-up each ``*.hkv`` file's header is read. A bad magic, a header MAC mismatch, a name
    that does not match the header, or a size other than header + payload: the file is skipped,
    logged, counted (``corrupt[reason]``) and deleted. An unknown format version is skipped,
    logged and counted but left in place (another hkvd version owns it). Leftover ``*.tmp`` files
    (a write cut short by a crash) are deleted. The payload CRC is checked on every read, after the
    bytes land in the pool; on a mismatch the file is deleted and the entry is never served.
    Files that are not ours (other names) are never touched.

Size cap
    The catalog's files (headers included) stay within ``--l2-size-gb``: before a write, the least
    recently written or read files go first. The order comes from mtimes at start-up; a read
    refreshes the file's mtime so the order survives a restart. Files of chunks a session pin holds
    (``held``, ``daemon/cache/pins.py``) are passed over while any other file can go; when only such
    files are left, the cap wins and they go too. Pins live in memory only: after a restart the files
    are ordered by their mtimes alone (docs/pins.md).

Threading
    One writer thread drains the queue; a small read pool runs lookups' reads and the start-up
    scan. Catalog changes hold ``_lock``; the event loop's membership probes read the dict without
    it (one dict probe is atomic in CPython), as the writer thread's ``held`` probes of the pin table
    do. Each counter is written by one thread only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import logging
import os
import secrets
import stat
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hkvd.daemon.cache import Extent
from hkvd.daemon.integrity.checksums import Digest
from hkvd.daemon.metrics import RateWindow
from hkvd.daemon.secret_files import not_private, private_fix
from hkvd.daemon.startup_errors import StartupError
from hkvd.daemon.tiers.contract import Source, Tier
from hkvd.daemon.tiers.disk_format import (
    HEADER_BYTES,
    SHARDS,
    SUFFIX,
    TMP_SUFFIX,
    EntryKey,
    FormatError,
    Header,
    relative_path,
    unpack_header,
)
from hkvd.daemon.tiers.disk_scan import DiskScan, ScanReport, Stored
from hkvd.daemon.tiers.write_queue import WriteJob, WriteQueue
from hkvd.transport.stat_fields import metric, part, status_only

log = logging.getLogger("hkvd.disk")

KEY_FILE = "hkvd.key"
SECRET_BYTES = 32
ERROR_LOG_EVERY_S = 60.0


class DiskTierError(StartupError, OSError):
    """The disk tier cannot start (directory missing, not writable); the message names the fix."""


# ---- the directory ----------------------------------------------------------------------------------


def _check_private(path: Path) -> None:
    """Refuse a directory another user owns or may write to: they could plant files or links in it."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise DiskTierError(errno.ENOTDIR, f"--l2-path: {path} is not a directory (a symbolic link?); point "
                                           "--l2-path at a real directory of the daemon's own")
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DiskTierError(errno.EPERM, f"--l2-path: {path} is owned by uid {st.st_uid} with mode "
                                         f"{stat.S_IMODE(st.st_mode):04o}; the disk tier needs a directory that "
                                         f"only the daemon's user (uid {os.geteuid()}) may write: `chown "
                                         f"{os.geteuid()} {path} && chmod 700 {path}`, or choose another one")


def load_secret(root: Path) -> bytes:
    """The directory's MAC key: read ``<root>/hkvd.key``, or make it. Raises ``DiskTierError`` if it is unsafe."""
    path = root / KEY_FILE
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        tmp = root / f"{KEY_FILE}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, secrets.token_bytes(SECRET_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)  # a key is whole or absent: two starts racing end with one of theirs
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise DiskTierError(e.errno or errno.EIO, f"--l2-path: cannot open the directory's key {path} ({e.strerror}); "
                                                  f"it must be a regular file: remove it (the tier's files are then "
                                                  "dropped at start) and restart") from None
    try:
        st = os.fstat(fd)
        secret = os.read(fd, SECRET_BYTES + 1)
    finally:
        os.close(fd)
    why = not_private(st)
    if why:
        raise DiskTierError(errno.EPERM, f"--l2-path: the key {path} {why}; it must be the daemon's and private: "
                                         f"{private_fix(str(path))}, or remove it (the tier's files are then "
                                         "dropped at start)")
    if len(secret) != SECRET_BYTES:
        raise DiskTierError(errno.EINVAL, f"--l2-path: the key {path} holds {len(secret)} bytes, not "
                                          f"{SECRET_BYTES}; remove it (the tier's files are then dropped at start)")
    return secret


def _write_all(fd: int, data: memoryview | bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd: int, into: memoryview) -> None:
    got = 0
    while got < len(into):
        n = os.readv(fd, [into[got:]])
        if n == 0:
            raise FormatError("truncated", f"file ends {len(into) - got} bytes early")
        got += n


# ---- the tier ----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class DiskScanStats:
    """What the start-up scan found (``hkvd status``: ``l2.scan``)."""

    entries: int = status_only()
    files: int = status_only()
    seconds: float = status_only()
    tmp_removed: int = status_only()
    evicted: int = status_only()


@dataclass(frozen=True, slots=True)
class DiskStats:
    """The disk tier (``hkvd status``: ``l2``; /metrics: ``hkvd_l2_*``)."""

    path: str = status_only()
    cap_bytes: int = metric("hkvd_l2_capacity_bytes", "The disk tier's cap (--l2-size-gb)")
    entries: int = metric("hkvd_l2_entries", "Entries in the disk tier's catalog")
    bytes: int = metric("hkvd_l2_bytes", "Bytes of the disk tier's files")
    queued: int = metric("hkvd_l2_queued_entries", "Entries waiting in the write-behind queue")
    queued_bytes: int = status_only()
    writes: int = metric("hkvd_l2_writes", "Entries written to the disk tier", "counter")
    write_bytes: int = metric("hkvd_l2_write_bytes", "Bytes written to the disk tier (headers included)", "counter")
    write_errors: int = metric("hkvd_l2_write_errors", "Disk-tier writes that failed (disk full, I/O error)",
                               "counter")
    queue_drops: int = metric("hkvd_l2_queue_drops", "Entries not written because the write-behind queue was full",
                              "counter")
    evictions: int = metric("hkvd_l2_evictions", "Disk-tier files deleted to stay under --l2-size-gb", "counter")
    reads: int = metric("hkvd_l2_reads", "Disk-tier files read and verified", "counter")
    read_bytes: int = metric("hkvd_l2_read_bytes", "Payload bytes read from the disk tier", "counter")
    read_errors: int = metric("hkvd_l2_read_errors", "Disk-tier reads that failed with an I/O error", "counter")
    corrupt: dict[str, int] = metric("hkvd_l2_corrupt_files", "Disk-tier files skipped as unusable (and deleted, "
                                     "except another format version), by reason", "counter", key="reason")
    write_gbps: float = metric("hkvd_l2_write_gbps", "Disk-tier write throughput, last 64 files")
    read_gbps: float = metric("hkvd_l2_read_gbps", "Disk-tier read throughput, last 64 files")
    scan: DiskScanStats = part()


class DiskTier(Tier[DiskStats]):
    """See the module docstring. ``buffer`` is the pool's memoryview (entries' extents index it)."""

    name = "l2"
    label = "disk tier"

    def __init__(self, root: str, cap_bytes: int, buffer: memoryview, *, queue_bytes: int,
                 queue_entries: int = 4096, read_threads: int = 2, budget_s: float = 10.0) -> None:
        self.budget_s = budget_s
        self.root = Path(root).absolute()
        self.cap_bytes = cap_bytes
        self.buffer = buffer
        self.queue_bytes = queue_bytes
        self.queue_entries = queue_entries
        self.read_threads = read_threads
        self.secret = b""  # the directory's MAC key, read by ``open``
        self.readers = ThreadPoolExecutor(max_workers=read_threads, thread_name_prefix="hkvd-l2-read")
        self.executor = self.readers
        self._catalog: collections.OrderedDict[EntryKey, Stored] = collections.OrderedDict()
        self._catalog_bytes = 0
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue = WriteQueue(queue_entries, queue_bytes)
        self._writing = False
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._writer: threading.Thread | None = None
        self._reads_running = 0
        self.write_rate = RateWindow()
        self.read_rate = RateWindow()
        self.scan = ScanReport()
        # counters (each written by one thread)
        self.writes = self.write_bytes = self.write_errors = 0  # writer thread
        self.evictions = 0  # writer thread (and the scan, before it starts)
        self.queue_drops = 0  # event loop
        self.reads = self.read_bytes = self.read_errors = 0  # read pool threads, under _lock
        self.corrupt: dict[str, int] = {}
        self.pinned_skips = 0  # writer thread: files passed over by eviction because a pin held them
        # Whether a session pin holds an entry's chunk (the index's pin table); None: no pins.
        self.held: Callable[[EntryKey], bool] | None = None
        self._last_error_log = 0.0
        self._errors_since_log = 0

    # ---- start-up (blocking: run on a thread) ------------------------------------------------
    def open(self, progress: Callable[[int, float], None] | None = None) -> ScanReport:
        """Create or check the directory, then scan it into the catalog. Raises ``DiskTierError``."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            _check_private(self.root)
            for shard in SHARDS:
                (self.root / shard).mkdir(mode=0o700, exist_ok=True)
                _check_private(self.root / shard)
            probe = self.root / f".probe-{os.getpid()}{TMP_SUFFIX}"
            probe.write_bytes(b"hkvd")
            probe.unlink()
            self.secret = load_secret(self.root)
        except DiskTierError:
            raise
        except OSError as e:
            raise DiskTierError(e.errno or errno.EIO,
                                f"--l2-path {self.root}: cannot use it as the disk tier ({e.strerror or e}); "
                                "point it at a writable directory on a local disk (e.g. /var/cache/hkvd), "
                                "or leave --l2-path unset") from None
        self._scan(progress)
        return self.scan

    def _scan(self, progress: Callable[[int, float], None] | None) -> None:
        rep = self.scan
        start = time.monotonic()
        scan = DiskScan(self.root, self.secret, rep, count_corrupt=self._count_corrupt, unlink=self._unlink)
        found = scan.run(progress)
        with self._lock:
            for _mtime, key, stored in found:
                self._catalog[key] = stored
            self._catalog_bytes = rep.bytes
            rep.evicted = self._evict_to(self.cap_bytes)
        rep.entries = len(self._catalog)
        rep.bytes = self._catalog_bytes
        rep.seconds = time.monotonic() - start
        scan.log_summary(self.cap_bytes)

    def _count_corrupt(self, reason: str) -> None:
        with self._lock:
            self.corrupt[reason] = self.corrupt.get(reason, 0) + 1

    @staticmethod
    def _unlink(path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("disk tier: cannot delete %s: %s", path, e)

    def _evict_to(self, limit: int) -> int:
        """Delete the oldest files until the catalog holds at most ``limit`` bytes. Holds ``_lock``."""
        gone = []
        held = self.held
        passed = 0  # held files moved to the back this call: once all of them were, the cap wins
        catalog = self._catalog
        while catalog and self._catalog_bytes > limit:
            key, stored = catalog.popitem(last=False)
            if held is not None and passed < len(catalog) + 1 and held(key):
                catalog[key] = stored  # to the back: the files behind it go first
                passed += 1
                continue
            self._catalog_bytes -= stored.file_bytes
            self._unlink(stored.path)
            gone.append(key)
        self.pinned_skips += passed
        n = len(gone)
        self.evictions += n
        if gone:
            self._changed(gone, False)
        return n

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._writer = threading.Thread(target=self._write_loop, name="hkvd-l2-write", daemon=True)
        self._writer.start()

    # ---- event loop side ---------------------------------------------------------------------
    def __contains__(self, key: EntryKey) -> bool:
        return key in self._catalog

    def __len__(self) -> int:
        return len(self._catalog)

    def get(self, key: EntryKey) -> Stored | None:
        return self._catalog.get(key)

    # ---- Tier (lookups read through it: daemon/tiers/promotion.py) -----------------------
    def usable(self) -> bool:
        return bool(self._catalog)

    async def holds(self, keys: Sequence[EntryKey]) -> set[EntryKey]:
        return {k for k in keys if k in self._catalog}

    def source(self, key: EntryKey, nbytes: int, kind: str, parent: bytes) -> Source | str:
        stored = self._catalog.get(key)
        if stored is None:  # evicted since the lookup asked
            return "gone"
        if stored.nbytes != nbytes or stored.kind != kind:
            self.discard(key, stored, "layout")
            log.warning("disk tier: %s holds %d bytes of kind %s; this layout's entries are %d bytes of %s; "
                        "deleted", stored.path, stored.nbytes, stored.kind, nbytes, kind)
            return "layout"
        return Source(stored, stored.parent)

    def offer(self, key: EntryKey, kind: str, nbytes: int, parent: bytes, extents: Sequence[Extent],
              done: Callable[[], None]) -> bool:
        """Queue a READY entry for writing. True: queued, ``done`` runs on the loop once it is written
        (or given up); the caller keeps the entry's pages pinned until then. False: not queued
        (already on disk or queued, or the queue is full: counted as a drop)."""
        with self._lock:
            if self._stopping or key in self._catalog or key in self._queue:
                return False
            if not self._queue.has_room(nbytes) or HEADER_BYTES + nbytes > self.cap_bytes:
                self.queue_drops += 1
                return False
            self._queue.push(WriteJob(key, kind, nbytes, parent, tuple(extents), done))
            self._cond.notify()
        return True

    def pending(self) -> int:
        """Entries queued or being written."""
        with self._lock:
            return len(self._queue) + self._writing

    def discard(self, key: EntryKey, stored: Stored, reason: str) -> None:
        """Drop a file that failed a check: count it, delete it, never serve it again."""
        with self._lock:
            if self._catalog.get(key) is stored:
                del self._catalog[key]
                self._catalog_bytes -= stored.file_bytes
                self._changed([key], False)
            self.corrupt[reason] = self.corrupt.get(reason, 0) + 1
        self._unlink(stored.path)

    # ---- writer thread -----------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                (job,) = self._queue.take(1)
                self._writing = True
            try:
                self._write(job)
            except Exception as e:  # a full or failing disk must not stop the writer
                self.write_errors += 1
                self._log_write_error(job, e)
            finally:
                with self._lock:
                    self._queue.finished(job)
                    self._writing = False
                self._notify(job.done)

    def _write(self, job: WriteJob) -> None:
        t0 = time.perf_counter()
        rel = relative_path(job.key)
        final = str(self.root / rel)
        # An unpredictable name, created exclusively and never through a link planted in the directory.
        tmp = f"{final[: -len(SUFFIX)]}.{secrets.token_hex(8)}{TMP_SUFFIX}"
        size = HEADER_BYTES + job.nbytes
        with self._lock:
            if job.key in self._catalog:
                return
            self._evict_to(self.cap_bytes - size)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.lseek(fd, HEADER_BYTES, os.SEEK_SET)
            crc = 0
            digest = Digest()
            for off, length in job.extents:
                with self.buffer[off:off + length] as mv:
                    crc = zlib.crc32(mv, crc)
                    digest.update(mv)
                    _write_all(fd, mv)
            # Damage in the pool since the entry's checksum was taken: no file, and the entry goes.
            checks = self.checks
            if checks is not None and (want := checks.expected(job.key)) and (found := digest.value()) != want:
                os.close(fd)
                self._unlink(tmp)
                checks.report(job.key, "disk_write", found)
                return
            fp, gid, ck = job.key
            header = Header(fp, gid, ck, job.kind, job.nbytes, crc, job.parent).pack(self.secret)
            if os.pwrite(fd, header, 0) != HEADER_BYTES:
                raise OSError(errno.EIO, "short header write")
        except BaseException:
            os.close(fd)
            self._unlink(tmp)
            raise
        os.close(fd)
        os.rename(tmp, final)
        with self._lock:
            self._catalog[job.key] = Stored(final, job.nbytes, job.kind, job.parent, size)
            self._catalog_bytes += size
        self._changed([job.key], True)
        self.writes += 1
        self.write_bytes += size
        self.write_rate.add(size, time.perf_counter() - t0)

    def _log_write_error(self, job: WriteJob, e: Exception) -> None:
        self._errors_since_log += 1
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_EVERY_S:
            log.warning("disk tier: %d writes failed in the last %.0f s (latest: %s: %s); the entries stay in the "
                        "pool only", self._errors_since_log, min(now - self._last_error_log, ERROR_LOG_EVERY_S),
                        relative_path(job.key), e)
            self._last_error_log = now
            self._errors_since_log = 0

    def _notify(self, done: Callable[[], None]) -> None:
        if self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to unpin
            self._loop.call_soon_threadsafe(done)

    def _changed(self, keys: list[EntryKey], present: bool) -> None:
        """Tell ``listener`` (on the loop) that the catalog took or lost ``keys``; nothing before ``start``
        (the start-up scan's files are known to nobody yet)."""
        listener = self.listener
        if listener is None or self._loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self._loop.call_soon_threadsafe(listener, keys, present)

    # ---- read pool ---------------------------------------------------------------------------
    def read_batch(self, jobs: Sequence[tuple[EntryKey, object, Sequence[Extent]]]) -> list[BaseException | None]:
        """Read entries into pool extents and check them; one result per job (None: read and verified).

        Runs on the read pool. A ``FormatError`` (checksum, truncated, header) deletes the file."""
        with self._lock:
            self._reads_running += 1
        try:
            out: list[BaseException | None] = []
            for key, stored, extents in jobs:
                if not isinstance(stored, Stored):  # the handle source() gave is a Stored
                    out.append(TypeError(f"disk tier: a {type(stored).__name__} is no disk-tier handle"))
                    continue
                try:
                    self._read(key, stored, extents)
                    out.append(None)
                except FormatError as e:
                    self.discard(key, stored, e.reason)
                    log.warning("disk tier: %s is corrupt (%s): deleted, never served", stored.path, e)
                    out.append(e)
                except BaseException as e:  # OSError (file evicted meanwhile, I/O error): a miss
                    with self._lock:
                        self.read_errors += 1
                    out.append(e)
            return out
        finally:
            with self._lock:
                self._reads_running -= 1

    def _read(self, key: EntryKey, stored: Stored, extents: Sequence[Extent]) -> None:
        t0 = time.perf_counter()
        fd = os.open(stored.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            raw = os.read(fd, HEADER_BYTES)
            header = unpack_header(raw, self.secret)
            if header.key != key or header.nbytes != stored.nbytes:
                raise FormatError("header", "the header names another entry than the catalog")
            crc = 0
            for off, length in extents:
                with self.buffer[off:off + length] as mv:
                    _read_exact(fd, mv)
                    crc = zlib.crc32(mv, crc)
            if crc != header.checksum:
                raise FormatError("checksum", f"payload CRC-32 {crc:08x}, header says {header.checksum:08x}")
        finally:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.utime(stored.path)  # recently used: evicted last, also after a restart
        with self._lock:
            if self._catalog.get(key) is stored:
                self._catalog.move_to_end(key)
            self.reads += 1
            self.read_bytes += stored.nbytes
        self.read_rate.add(stored.nbytes, time.perf_counter() - t0)

    # ---- shutdown ----------------------------------------------------------------------------
    def close(self, timeout_s: float) -> int:
        """Stop the writer after the entry it is writing; return how many queued entries were not
        written (their ``done`` still runs). Blocking: call from a thread."""
        with self._cond:
            dropped = self._queue.drain()
            self._stopping = True
            self._cond.notify_all()
        for job in dropped:
            self._notify(job.done)
        if self._writer is not None:
            self._writer.join(timeout_s)
        self.readers.shutdown(wait=False)  # queued reads still run: lookups await them (failing once the pool closes)
        return len(dropped) + (1 if self.busy() else 0)

    def busy(self) -> bool:
        """A thread may still touch pool memory (the writer mid-write, or a read running)."""
        return (self._writer is not None and self._writer.is_alive()) or self._reads_running > 0

    # ---- stats -------------------------------------------------------------------------------
    def statistics(self) -> DiskStats:
        with self._lock:
            entries, nbytes, queued, queued_bytes = (len(self._catalog), self._catalog_bytes,
                                                     len(self._queue) + self._writing, self._queue.bytes)
            corrupt = dict(self.corrupt)
        scan = self.scan
        return DiskStats(
            path=str(self.root), cap_bytes=self.cap_bytes, entries=entries, bytes=nbytes, queued=queued,
            queued_bytes=queued_bytes, writes=self.writes, write_bytes=self.write_bytes,
            write_errors=self.write_errors, queue_drops=self.queue_drops, evictions=self.evictions, reads=self.reads,
            read_bytes=self.read_bytes, read_errors=self.read_errors, corrupt=corrupt,
            write_gbps=self.write_rate.gbps(), read_gbps=self.read_rate.gbps(),
            scan=DiskScanStats(entries=scan.entries, files=scan.files_seen, seconds=scan.seconds,
                               tmp_removed=scan.tmp_removed, evicted=scan.evicted),
        )
