"""The disk tier's start-up scan: every file's header read and checked into catalog records.

Runs once per start, on a read-pool thread, before the tier's writer starts (``DiskTier.open``). A
file is skipped, counted (``corrupt[reason]``) and deleted on a bad magic, a header MAC mismatch, a
name that does not match its header, or a size other than header + payload; a file of another
format version is counted but left in place. Leftover ``*.tmp`` files are deleted; files that are not
ours are never touched. Checks and counts are the module docstring's of ``hkvd.daemon.tiers.disk``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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

log = logging.getLogger("hkvd.disk")

PROGRESS_EVERY_S = 1.0
MAX_LOGGED_FILES = 10  # corrupt files named one by one at start-up; the rest are summed up


@dataclass(slots=True)
class Stored:
    """One catalog record: where an entry's file is and what it holds."""

    path: str
    nbytes: int
    kind: str
    parent: bytes
    file_bytes: int


@dataclass(slots=True)
class ScanReport:
    entries: int = 0
    bytes: int = 0
    files_seen: int = 0
    tmp_removed: int = 0
    ignored: int = 0
    evicted: int = 0
    seconds: float = 0.0
    corrupt: dict[str, int] = field(default_factory=dict)


class DiskScan:
    """One scan of ``root``'s shards into ``report``.

    ``count_corrupt`` adds an unusable file to the tier's counters; ``unlink`` deletes a file, logging
    rather than raising on failure. Blocking: call from a thread.
    """

    def __init__(self, root: Path, secret: bytes, report: ScanReport, *, count_corrupt: Callable[[str], None],
                 unlink: Callable[[str], None]) -> None:
        self.root = root
        self.secret = secret
        self.report = report
        self._count_corrupt = count_corrupt
        self._unlink = unlink
        self._named = 0  # unusable files logged one by one

    def run(self, progress: Callable[[int, float], None] | None) -> list[tuple[int, EntryKey, Stored]]:
        """The usable files as (mtime in ns, key, record), oldest first: the eviction order."""
        rep = self.report
        last = time.monotonic()
        found: list[tuple[int, EntryKey, Stored]] = []
        for shard in SHARDS:
            try:
                it = os.scandir(self.root / shard)
            except FileNotFoundError:
                continue
            with it:
                for de in it:
                    rep.files_seen += 1
                    now = time.monotonic()
                    if now - last >= PROGRESS_EVERY_S:
                        last = now
                        log.info("disk tier: scanning %s: %d files, %d entries (%.1f GiB) so far", self.root,
                                 rep.files_seen, len(found), rep.bytes / (1 << 30))
                        if progress is not None:
                            progress(rep.files_seen, rep.bytes)
                    record = self._visit(shard, de)
                    if record is not None:
                        found.append(record)
                        rep.bytes += record[2].file_bytes
        found.sort(key=lambda t: t[0])
        return found

    def _visit(self, shard: str, de: os.DirEntry[str]) -> tuple[int, EntryKey, Stored] | None:
        """The catalog record of one directory entry, or None when it is not a usable file of ours."""
        rep = self.report
        if de.name.endswith(TMP_SUFFIX):
            self._unlink(de.path)
            rep.tmp_removed += 1
            return None
        if not de.name.endswith(SUFFIX) or not de.is_file(follow_symlinks=False):
            rep.ignored += 1
            return None
        try:
            st, header = self._check(shard, de)
        except FormatError as e:
            self._reject(de.path, e)
            return None
        except OSError as e:
            rep.ignored += 1
            log.warning("disk tier: cannot read %s: %s; skipped", de.path, e)
            return None
        return st.st_mtime_ns, header.key, Stored(de.path, header.nbytes, header.kind, header.parent, st.st_size)

    def _check(self, shard: str, de: os.DirEntry[str]) -> tuple[os.stat_result, Header]:
        """The file's stat and checked header; raises ``FormatError`` (or ``OSError``)."""
        st = de.stat(follow_symlinks=False)
        fd = os.open(de.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            header = unpack_header(os.read(fd, HEADER_BYTES), self.secret)
        finally:
            os.close(fd)
        if f"{shard}/{de.name}" != relative_path(header.key):
            raise FormatError("name", "file name does not match the key in its header")
        if st.st_size != HEADER_BYTES + header.nbytes:
            raise FormatError("truncated" if st.st_size < HEADER_BYTES + header.nbytes else "size",
                              f"{st.st_size} bytes, header says {HEADER_BYTES + header.nbytes}")
        return st, header

    def _reject(self, path: str, e: FormatError) -> None:
        """Count an unusable file and delete it, unless another format version owns it."""
        rep = self.report
        rep.corrupt[e.reason] = rep.corrupt.get(e.reason, 0) + 1
        self._count_corrupt(e.reason)
        keep = e.reason == "version"
        if self._named < MAX_LOGGED_FILES:
            self._named += 1
            log.warning("disk tier: skipping %s: %s (%s)", path, e, "left in place" if keep else "deleted")
        if not keep:
            self._unlink(path)

    def log_summary(self, cap_bytes: int) -> None:
        """Log what the scan found, once the catalog took the files (``report`` complete)."""
        rep = self.report
        bad = sum(rep.corrupt.values())
        if self._named < bad:
            log.warning("disk tier: %d more unusable files skipped (see hkvd_l2_corrupt_files_total)",
                        bad - self._named)
        log.info("disk tier: %s holds %d entries (%.2f GiB of a %.2f GiB cap), scanned %d files in %.1f s; "
                 "skipped %d unusable (%s), removed %d unfinished writes, evicted %d over the cap, "
                 "ignored %d other files", self.root, rep.entries, rep.bytes / (1 << 30), cap_bytes / (1 << 30),
                 rep.files_seen, rep.seconds, bad, ", ".join(f"{k} {v}" for k, v in sorted(rep.corrupt.items()))
                 or "none", rep.tmp_removed, rep.evicted, rep.ignored)
