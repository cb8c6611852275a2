"""The scrubber: READY pool entries re-hashed at a bounded rate, a mismatch dropped.

Role
    Walks the index in passes (a pass: every key present when it began, in insertion order; a pass
    begins at most every ``MIN_PASS_S`` seconds) and re-hashes each READY entry's bytes at no more
    than ``--scrub-rate-mb`` MB/s on average (0: no scrubber). An entry whose bytes no longer hash
    to its checksum is dropped (``Checksums.mark``: a miss from then on, never wrong bytes); an
    entry still without a checksum (its hash was skipped, or pending) gets the one computed here.
    docs/checksums.md.

Threading
    One thread. The loop hands it a batch (``take``: entries and their extents, on the loop, so the
    index is read where it is owned), it hashes them paced by ``Pace`` (sleeping between entries),
    and hands the results back (``settle``, on the loop), which trusts a hash only for an entry that
    is still the key's READY entry (``daemon/integrity/checksums.py``: why that leaves no race).

Failure
    A hand-off that the loop does not answer within ``HANDOFF_TIMEOUT_S`` (a stopped loop) ends the
    thread quietly at shutdown; otherwise it is retried. The scrubber never fails a request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hkvd.daemon.cache import Cache, Entry, EntryKey, EntryState
from hkvd.daemon.integrity.checksums import Checksums, checksum
from hkvd.transport.stat_fields import metric

BATCH_BYTES = 32 << 20  # at most this much (or one entry) per hand-off
BATCH_ENTRIES = 4096
IDLE_S = 1.0  # wait this long when the pool holds nothing to scrub (or the pass ended early)
MIN_PASS_S = 5.0  # a pass over a small pool starts no sooner than this after the one before
HANDOFF_TIMEOUT_S = 5.0
BURST_S = 0.1  # the pace lends at most this much time's worth of bytes ahead
MIN_SLEEP_S = 0.01  # shorter waits are left to add up (each wait costs CPU of its own)

_SCRUB = "Pool entries re-hashed by the scrubber"


class Pace:
    """The rate limit: ``delay(n)`` is how long to wait before hashing ``n`` more bytes so that the bytes
    hashed in any span of ``t`` seconds stay within ``rate * (t + burst_s)`` (plus one entry)."""

    def __init__(self, rate_bytes_s: float, clock: Callable[[], float] = time.monotonic,
                 burst_s: float = BURST_S) -> None:
        if rate_bytes_s <= 0:
            raise ValueError(f"the scrub rate must be positive, got {rate_bytes_s}")
        self.rate = rate_bytes_s
        self.clock = clock
        self.burst_s = burst_s
        self._due = clock()  # when the bytes allowed so far are paid for

    def delay(self, nbytes: int) -> float:
        now = self.clock()
        due = max(self._due, now - self.burst_s)  # idle time builds no more than a burst of credit
        wait = max(0.0, due - now)
        self._due = due + nbytes / self.rate
        return wait


@dataclass(frozen=True, slots=True)
class IntegrityStats:
    """Checksums and the scrubber (``hkvd status``: ``integrity``); the entries dropped are the index's
    ``corrupt`` (``hkvd_pool_corrupt_total``)."""

    checksums_taken: int = metric("hkvd_checksums_taken", "Entry checksums taken after their bytes landed",
                                  "counter")
    checksums_skipped: int = metric("hkvd_checksums_skipped", "Entries whose checksum was left to the scrubber "
                                    "(the hashing queue was full)", "counter")
    checksums_queued: int = metric("hkvd_checksums_queued", "Entries waiting for their checksum")
    mismatches: dict[str, int] = metric("hkvd_checksum_mismatches", "Checksum mismatches found, by where (scrub, "
                                        "disk_write, cluster_put, peer_pull)", "counter", key="where")
    scrub_rate_mb: int = metric("hkvd_scrub_rate_mb", "The scrubber's limit in MB/s (0: off)")
    scrub_entries: int = metric("hkvd_scrub_entries", _SCRUB, "counter")
    scrub_bytes: int = metric("hkvd_scrub_bytes", "Bytes re-hashed by the scrubber", "counter")
    scrub_adopted: int = metric("hkvd_scrub_adopted", "Entries the scrubber gave their first checksum", "counter")
    scrub_passes: int = metric("hkvd_scrub_passes", "Scrub passes completed over the whole index", "counter")
    scrub_cpu_s: float = metric("hkvd_scrub_cpu_seconds", "CPU time of the scrubber's thread", "counter")


class Scrubber:
    """Re-hashes READY entries at a bounded rate (module docstring). Without ``start`` nothing runs:
    ``take`` / ``hash`` / ``settle`` are the three steps, each callable on its own (tests)."""

    def __init__(self, cache: Cache, checks: Checksums, rate_mb: int, *,
                 clock: Callable[[], float] = time.monotonic, min_pass_s: float = MIN_PASS_S) -> None:
        self.cache = cache
        self.clock = clock
        self.min_pass_s = min_pass_s
        self._pass_began = -float("inf")
        self.checks = checks
        self.rate_mb = rate_mb
        self.pace = Pace(rate_mb * 1_000_000, clock) if rate_mb > 0 else None
        self._keys: list[EntryKey] = []
        self._cursor = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cpu_s = 0.0  # the thread's CPU time, written by it
        self.entries = 0
        self.bytes = 0
        self.adopted = 0
        self.passes = 0

    # ---- loop side -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.pace is None:
            return
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="hkvd-scrub", daemon=True)
        self._thread.start()

    def take(self, max_bytes: int = BATCH_BYTES, max_entries: int = BATCH_ENTRIES) -> list[Entry]:
        """The next READY entries of this pass, up to ``max_bytes`` (at least one entry); a new pass
        begins when the last one's keys are used up, and no sooner than ``min_pass_s`` after the last
        one began (a small pool is not re-hashed over and over). Empty: nothing to hash now."""
        out: list[Entry] = []
        nbytes = 0
        get, ready = self.cache.get, EntryState.READY
        wrapped = False
        while len(out) < max_entries and nbytes < max_bytes:
            if self._cursor >= len(self._keys):
                if wrapped or self.clock() - self._pass_began < self.min_pass_s:
                    break  # the next pass waits (a whole pass fit in this batch, or the last began too recently)
                wrapped = True
                self._pass_began = self.clock()
                self._keys = self.cache.keys()
                self._cursor = 0
                if not self._keys:
                    break
            e = get(self._keys[self._cursor])
            self._cursor += 1
            if self._cursor == len(self._keys):
                self.passes += 1
            if e is not None and e.state is ready:
                out.append(e)
                nbytes += e.nbytes
        return out

    def settle(self, results: list[tuple[Entry, int]]) -> None:
        """Results of ``hash``: a READY entry still in the index whose hash differs from its checksum is
        dropped; one without a checksum gets this one."""
        get, ready = self.cache.get, EntryState.READY
        for entry, value in results:
            if get(entry.key) is not entry or entry.state is not ready:
                continue  # gone or changed since: its pages may hold other bytes now
            self.entries += 1
            self.bytes += entry.nbytes
            if not entry.checksum:
                entry.checksum = value
                self.adopted += 1
            elif entry.checksum != value:
                self.checks.mark(entry.key, "scrub", value, entry)

    def statistics(self) -> IntegrityStats:
        checks = self.checks
        return IntegrityStats(checks.taken, checks.skipped, checks.pending(), dict(checks.mismatches), self.rate_mb,
                              self.entries, self.bytes, self.adopted, self.passes, round(self._cpu_s, 3))

    # ---- thread ---------------------------------------------------------------------------------
    def hash(self, batch: list[Entry], wait: Callable[[float], object] = time.sleep) -> list[tuple[Entry, int]]:
        """Hash ``batch`` at the pace (``wait(seconds)`` between entries; stops early once stopped)."""
        out: list[tuple[Entry, int]] = []
        buffer = self.checks.buffer
        for e in batch:
            if self.pace is not None:
                delay = self.pace.delay(e.nbytes)
                if delay >= MIN_SLEEP_S:
                    wait(delay)
            if self._stop.is_set():
                break
            out.append((e, checksum(buffer, e.alloc.extents)))
        return out

    def _next_batch(self) -> list[Entry] | None:
        """``take`` run on the loop; None when the loop is gone or stopping."""
        loop = self._loop
        if loop is None or self._stop.is_set():
            return None
        fut: concurrent.futures.Future[list[Entry] | None] = concurrent.futures.Future()

        def call() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(self.take())
            except BaseException as e:  # reported on the thread, which stops
                fut.set_exception(e)
        try:
            loop.call_soon_threadsafe(call)
            return fut.result(HANDOFF_TIMEOUT_S)
        except (RuntimeError, concurrent.futures.TimeoutError):
            fut.cancel()
            return None

    def _run(self) -> None:
        t0 = time.thread_time()
        while not self._stop.is_set():
            batch = self._next_batch()
            if batch is None:
                if self._stop.wait(IDLE_S):
                    break
                continue
            if not batch:
                self._stop.wait(IDLE_S)
                continue
            results = self.hash(batch, self._stop.wait)
            self._cpu_s = time.thread_time() - t0
            if results and self._loop is not None:
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(self.settle, results)

    def stop(self, timeout_s: float) -> bool:
        """Stop the thread (before the pool is unmapped); False if it did not end within ``timeout_s``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True
