"""Entry checksums: an XXH3-64 of each pool entry's bytes, taken once they are final.

Role
    ``checksum`` hashes an entry's bytes (its pool extents in entry order). ``Checksums`` takes every
    entry's checksum after it turns READY (stored, promoted from a lower tier, pulled from a peer, a
    Mamba state once confirmed): the index calls ``submit`` (``Index.on_checksum``), a worker thread
    hashes, and the loop writes ``Entry.checksum``. A store's StoreResult never waits for it; an entry whose
    checksum is not taken yet is served as is. The tiers ask ``expected`` for the checksum of an entry
    they move and ``report`` a mismatch; ``mark`` (on the loop) drops the entry (``Index.mark_corrupt``)
    and logs it. The scrubber (``daemon/integrity/scrub.py``) re-checks READY entries at a bounded
    rate. docs/checksums.md says what is checked when.

Why no race
    A READY entry's bytes never change while it is in the index: stores, promotions and pulls only
    write WRITING entries, and a READY entry's pages go back to the pool only when it leaves the
    index. So a hash is trusted only if, back on the loop, the very ``Entry`` object is still the
    key's entry and still READY: then no byte under it was freed or rewritten during the hash.

Threading
    ``submit``, ``mark`` and ``statistics`` run on the event loop; ``expected`` and ``report`` on any
    thread (a tier's writer); hashing on the one worker thread. The queue holds ``_lock``.

Failure
    A full queue skips the entry (counted, ``skipped``): it stays without a checksum until the
    scrubber takes it. The checksum value 0 means "not taken", so a digest of 0 is stored as 1.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence

import xxhash

from hkvd.daemon.cache import Cache, Entry, EntryKey, EntryState, Extent

log = logging.getLogger(__name__)

#: Entries waiting for their checksum at most; beyond it they wait for the scrubber.
MAX_QUEUED = 65536
#: Bytes hashed between two hand-backs to the loop.
BATCH_BYTES = 64 << 20
REASON = "checksum"


class Digest:
    """An entry's checksum taken piece by piece (a tier's writer hashes the bytes it writes)."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: memoryview | bytes) -> None:
        self._h.update(data)

    def value(self) -> int:
        """The checksum so far; never 0 (0 means "not taken")."""
        return self._h.intdigest() or 1


def checksum(buffer: memoryview, extents: Sequence[Extent] | Sequence[tuple[int, int]]) -> int:
    """The XXH3-64 of the bytes at ``extents`` of ``buffer``, in order; never 0 (0 means "not taken")."""
    if len(extents) == 1:  # most entries: one call
        off, length = extents[0]
        with buffer[off:off + length] as mv:
            return xxhash.xxh3_64_intdigest(mv) or 1
    d = Digest()
    for off, length in extents:
        with buffer[off:off + length] as mv:
            d.update(mv)
    return d.value()


def key_text(key: EntryKey) -> str:
    """An entry key as log lines name it: fingerprint, group, chunk key (hex prefixes)."""
    fp, gid, ck = key
    return f"fingerprint {fp.hex()[:12]} group {gid} chunk key {ck.hex()[:12]}"


class Checksums:
    """Every READY entry's checksum, taken on a worker thread (module docstring)."""

    def __init__(self, cache: Cache, buffer: memoryview, *, max_queued: int = MAX_QUEUED) -> None:
        self.cache = cache
        self.buffer = buffer
        self.max_queued = max_queued
        self._queue: collections.deque[Entry] = collections.deque()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.taken = 0  # checksums written (loop)
        self.skipped = 0  # entries a full queue turned away (loop)
        self.mismatches: dict[str, int] = {}  # where a move found damage -> count (loop)

    # ---- loop side -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hash from now on: the index's READY entries are submitted (``Index.on_checksum``)."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="hkvd-checksum", daemon=True)
        self._thread.start()
        self._unsubscribe = self.cache.subscribe(checksum=self.submit)

    def submit(self, entry: Entry) -> None:
        """Queue a READY entry for its checksum (skipped and counted when the queue is full); one that
        has it already (a pulled entry, checked against its source's) is left as it is."""
        if entry.checksum:
            return
        with self._lock:
            if len(self._queue) >= self.max_queued:
                self.skipped += 1
                return
            self._queue.append(entry)
            if len(self._queue) == 1:
                self._cond.notify()

    def settle(self, results: list[tuple[Entry, int]]) -> None:
        """Write checksums taken on the worker, for the entries still what they were when hashed."""
        get, ready = self.cache.get, EntryState.READY
        for entry, value in results:
            if get(entry.key) is entry and entry.state is ready and not entry.checksum:
                entry.checksum = value
                self.taken += 1

    def mark(self, key: EntryKey, where: str, found: int, entry: Entry | None = None) -> bool:
        """A move (``where``: disk write, cluster put, peer pull, scrub) found ``key``'s bytes hashing
        to ``found``, not to its checksum: drop the entry (a miss from now on) and log it. With
        ``entry``, only if it is still that entry. True if an entry was dropped."""
        self.mismatches[where] = self.mismatches.get(where, 0) + 1
        e = self.cache.get(key)
        if e is None or (entry is not None and e is not entry):
            return False
        log.warning("checksum mismatch (%s): %s hashes to %016x, its checksum is %016x; the entry is dropped and "
                    "never served (the engine recomputes it)", where, key_text(key), found, e.checksum)
        return self.cache.mark_corrupt(e, REASON)

    def note(self, key: EntryKey, where: str, found: int, want: int) -> None:
        """An entry not yet published (a peer pull's) hashed to ``found``, not ``want``: counted and
        logged; its caller gives it back, so it is never served."""
        self.mismatches[where] = self.mismatches.get(where, 0) + 1
        self.cache.note_corrupt(REASON)
        log.warning("checksum mismatch (%s): %s hashes to %016x, the source's checksum is %016x; the entry is "
                    "discarded and never served (the engine recomputes it)", where, key_text(key), found, want)

    def pending(self) -> int:
        with self._lock:
            return len(self._queue)

    # ---- any thread -----------------------------------------------------------------------------
    def expected(self, key: EntryKey) -> int:
        """The checksum of ``key``'s entry (0: none taken yet, or no such entry). Safe off the loop: the
        caller holds the entry pinned, and one dict probe and one attribute read are atomic."""
        e = self.cache.get(key)
        return e.checksum if e is not None else 0

    def report(self, key: EntryKey, where: str, found: int) -> None:
        """``mark`` from another thread (a tier's writer): queued to the loop, before that thread's
        later callbacks (its ``done`` unpin runs after this)."""
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the pool goes with it
            loop.call_soon_threadsafe(self.mark, key, where, found)

    # ---- worker -------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            batch: list[Entry] = []
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                nbytes = 0
                while self._queue and nbytes < BATCH_BYTES:
                    e = self._queue.popleft()
                    batch.append(e)
                    nbytes += e.nbytes
            get = self.cache.get
            # An entry gone since it was queued is not hashed (its pages may hold another entry by now).
            results = [(e, checksum(self.buffer, e.alloc.extents)) for e in batch if get(e.key) is e]
            self._post(self.settle, results)

    def _post(self, fn: Callable[[list[tuple[Entry, int]]], None], results: list[tuple[Entry, int]]) -> None:
        loop = self._loop
        if loop is not None and results:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(fn, results)

    def stop(self, timeout_s: float) -> bool:
        """Stop the worker (before the pool is unmapped); False if it did not end within ``timeout_s``."""
        self._unsubscribe()
        with self._cond:
            self._stopping = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True
