"""Background pre-fault of the pool: several threads fault superblocks in, in pool order, and hand
each one to the allocator only once every page of it is resident.

Role
    A 1 TB pool takes minutes to fault in even at several GB/s; the daemon must not wait for it.
    ``Prefaulter`` cuts the allocator's capacity into ranges (one superblock, or the superblocks of
    one huge page where pages are larger), and ``threads`` worker threads take the next range in
    order, fault it with ``populate(offset, nbytes)`` (``MADV_POPULATE_WRITE`` in the pool) and then
    call ``admit(first_superblock, count)``: only then can the allocator hand those superblocks out.
    So no copy ever lands in memory that is not faulted, and the daemon serves as soon as a first
    slice (``first_slice_bytes``) is in.

Threading
    Workers are plain threads (``hkvd-prefault-N``), daemonic so a hung fault never blocks exit.
    ``progress()`` and ``wait_for`` may be called from any thread; counters are under one lock.
    The first error (a populate that fails: hugetlb pages gone, a cgroup limit, no memory on the
    bound node) stops every worker; ``progress().error`` carries it. ``stop()`` lets each worker
    finish its current range (one superblock, 32 MiB at most: ~0.1 s at 0.4 GB/s) and returns once
    they have; the pool calls it before unmapping.

Contracts
    - ``admit`` is called exactly once per range, after ``populate`` of that whole range returned.
    - ``progress().faulted_bytes`` counts admitted bytes only; it reaches ``total_bytes`` iff
      ``done`` and no error.
    - ``on_done`` runs once, on the last worker, before ``done`` is reported: whoever sees ``done``
      sees what it did.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from hkvd.transport.stat_fields import status_only

log = logging.getLogger(__name__)

# More threads than this stop helping: page faults contend on the shmem / hugetlb locks of one
# file (measured on this VM in bench/prefault.py; bare-metal reports show the same knee near 8).
MAX_DEFAULT_THREADS = 8
# A first slice this large is faulted before the daemon serves: at 0.4 GB/s (one thread, 4 KiB
# pages, this VM) about 0.6 s; 1/8 of a smaller pool so small pools are ready sooner still.
FIRST_SLICE_BYTES = 256 << 20


def default_threads() -> int:
    """min(usable cores, 8)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except OSError:
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_DEFAULT_THREADS))


def first_slice_bytes(capacity: int, superblock_bytes: int) -> int:
    """Bytes faulted before serving: 1/8 of the pool, at most 256 MiB, at least one superblock."""
    want = min(FIRST_SLICE_BYTES, capacity // 8)
    return min(capacity, max(superblock_bytes, -(-want // superblock_bytes) * superblock_bytes))


class PrefaultProgress(NamedTuple):
    faulted_bytes: int
    total_bytes: int
    threads: int
    done: bool  # every worker has exited (finished, stopped or failed)
    error: str  # empty unless a populate failed
    elapsed_s: float  # since start, until done

    @property
    def gbps(self) -> float:
        return self.faulted_bytes / max(self.elapsed_s, 1e-9) / 1e9


@dataclass(frozen=True, slots=True)
class PrefaultStats:
    """The pre-fault's state (``hkvd status``: ``pool.prefault``); times and rates to 3 decimals."""

    threads: int = status_only()
    done: bool = status_only()
    error: str = status_only()  # empty unless a populate failed
    seconds: float = status_only()
    gbps: float = status_only()

    @classmethod
    def of(cls, p: PrefaultProgress) -> PrefaultStats:
        return cls(p.threads, p.done, p.error, round(p.elapsed_s, 3), round(p.gbps, 3))


class Prefaulter:
    def __init__(self, populate: Callable[[int, int], None], admit: Callable[[int, int], None], *,
                 capacity: int, superblock_bytes: int, page_size: int, threads: int,
                 on_done: Callable[[], object] | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._populate = populate
        self._admit = admit
        # Runs on the last worker once every range is done, before progress reports ``done``: whoever
        # sees ``done`` also sees what it did (the pool re-reads its backing there).
        self._on_done = on_done
        self.superblock_bytes = superblock_bytes
        # One range = one superblock, or all superblocks of one huge page when pages are larger
        # (1 GiB hugetlb pages): a populate must cover whole pages.
        self._per_range = max(1, page_size // superblock_bytes)
        self._superblocks = capacity // superblock_bytes
        self.total_bytes = self._superblocks * superblock_bytes
        self.threads = threads
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._next = 0  # next superblock to hand to a worker
        self._faulted = 0
        self._running = 0  # 0: done (every worker exited and on_done ran)
        self._active = 0  # workers not yet exited
        self._error = ""
        self._stop = False
        self._start = 0.0
        self._end = 0.0
        self._workers: list[threading.Thread] = []

    def start(self) -> Prefaulter:
        self._start = time.perf_counter()
        self._running = self._active = self.threads
        for i in range(self.threads):
            t = threading.Thread(target=self._work, name=f"hkvd-prefault-{i}", daemon=True)
            self._workers.append(t)
            t.start()
        return self

    def _take(self) -> tuple[int, int] | None:
        with self._lock:
            if self._stop or self._error or self._next >= self._superblocks:
                return None
            first = self._next
            count = min(self._per_range, self._superblocks - first)
            self._next += count
            return first, count

    def _work(self) -> None:
        try:
            while (job := self._take()) is not None:
                first, count = job
                try:
                    self._populate(first * self.superblock_bytes, count * self.superblock_bytes)
                except Exception as e:  # PoolError from the pool; anything else is as fatal to the fill
                    with self._changed:
                        self._error = self._error or str(e)
                        self._changed.notify_all()
                    return
                self._admit(first, count)
                with self._changed:
                    self._faulted += count * self.superblock_bytes
                    self._changed.notify_all()
        finally:
            with self._lock:
                self._active -= 1
                last = self._active == 0
            if last:
                self._finish()

    def _finish(self) -> None:
        if self._on_done is not None:
            try:
                self._on_done()
            except Exception:  # what it reports is a status; the fill itself is done either way
                log.exception("after pre-faulting the pool")
        with self._changed:
            self._running = 0
            self._end = time.perf_counter()
            self._changed.notify_all()

    def progress(self) -> PrefaultProgress:
        with self._lock:
            done = self._running == 0
            end = self._end if done else time.perf_counter()
            return PrefaultProgress(self._faulted, self.total_bytes, self.threads, done, self._error,
                                    end - self._start)

    def statistics(self) -> PrefaultStats:
        return PrefaultStats.of(self.progress())

    def wait_for(self, nbytes: int, timeout_s: float) -> PrefaultProgress:
        """Block until ``nbytes`` are admitted, the workers are done, or ``timeout_s`` passed."""
        with self._changed:
            self._changed.wait_for(lambda: self._faulted >= nbytes or self._running == 0, timeout_s)
        return self.progress()

    def stop(self) -> None:
        """Stop after the ranges in progress; return once every worker has exited. Idempotent."""
        with self._lock:
            self._stop = True
        for t in self._workers:
            t.join()
