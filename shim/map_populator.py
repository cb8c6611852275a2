# SPDX-License-Identifier: Apache-2.0
"""Page tables for an engine's map of its daemon's pool, built ahead of the in-step copies that read it.

Role
    ``Populator`` maps the pages of a fresh read-only pool map (``hkvd.shim.pool_reads.PoolMaps.map``) into this
    process's page tables with ``MADV_POPULATE_READ``, on a thread of its own, so that an in-step copy does not
    take those faults inside the step that needs its bytes.

Why
    A fresh map has no page tables: the first read of each 4 KiB page of a plain or THP-less memfd faults (one
    fault maps up to 16 resident pages, the kernel's ``fault_around_bytes``). Measured on a 2-vCPU x86_64 VM
    (Linux 6.18, 2026-12-03, busy: load 4-5), 64 x 2 MiB out of a fresh map ran at 0.54-0.58 of one
    contiguous memcpy of the same bytes, and at 0.98-1.12 once its pages were mapped; ``MADV_POPULATE_READ`` on
    the extents just before the copy costs the same (0.49-0.55: it takes the same faults), and ``MADV_WILLNEED``
    maps nothing (0.55-0.60). Each page faults once per engine process (the daemon never frees a pool page, and a
    page it rewrites stays mapped), so this is a cost of the first loads from every part of the pool, which a
    large pool spreads over a long time.

Cost
    On that VM: 66 ms of one CPU per GiB of 4 KiB pages (61-105 ms), plus 17 ms per GiB for ``mincore``, and
    2 MiB of page tables per GiB (4 KiB pages: one 8-byte entry each). A 64 GiB plain pool: ~5 s of one CPU once
    per map, behind the engine's start, and 128 MiB of page tables per engine process, which its loads would
    build anyway as they reach every part of the pool. A pool of 2 MiB pages (hugetlb, or THP mapped by PMD)
    needs one fault per 2 MiB, which costs nothing measurable next to copying it; see "Pages mapped" for why
    hugetlb is left to fault.

Pages mapped
    Only pages the daemon's memfd already holds (``mincore``, which reads the page cache for a shared file
    mapping): populating a hole would allocate the daemon's pool memory through the engine's map, charging it
    to the engine's memory cgroup. A daemon that is still pre-faulting its pool (just after a restart) holds only
    part of it; each pass that found pages missing is followed by another ``RETRY_S`` later, until a pass
    finds no new page (the pool is whole, or what is left is not coming). For hugetlb ``mincore`` reports the
    pages this process mapped, none in a fresh map, so nothing is populated: each 2 MiB page faults on its first
    read.

Threading and lifecycle
    ``start`` runs one daemon thread; ``madvise`` and ``mincore`` go through ctypes, which drops the GIL, so the
    engine's threads run meanwhile (``mmap.madvise`` would hold it for each call). ``stop`` (idempotent) asks the
    thread to end and joins it: it returns within one call on ``CHUNK_BYTES`` (~4 ms idle on that VM), so the map
    can be unmapped afterwards, never while a call on it runs. Nothing the thread does can fail a copy: a kernel
    without ``MADV_POPULATE_READ`` (before 5.14) or any error ends it, with one log line, and pages then fault as
    they are read.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable
from typing import cast

import numpy as np

from hkvd.transport.libc import LIBC

logger = logging.getLogger("hkvd.shim")

MADV_POPULATE_READ = 22  # Linux >= 5.14; not exported by Python 3.11's mmap module
PAGE = mmap.PAGESIZE
CHUNK_BYTES = 64 << 20  # one mincore + madvise: ~5 ms of one CPU for 4 KiB pages; what stop() waits for at most
RETRY_S = 2.0  # between passes while the daemon is still pre-faulting its pool


def _load() -> tuple[Callable[[int, int, int], int], Callable[[int, int, ctypes.Array[ctypes.c_ubyte]], int]]:
    madvise = LIBC.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    mincore = LIBC.mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    mincore.restype = ctypes.c_int
    return (cast(Callable[[int, int, int], int], madvise),
            cast(Callable[[int, int, ctypes.Array[ctypes.c_ubyte]], int], mincore))


_madvise, _mincore = _load()


def resident_runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """The runs of resident pages in a ``mincore`` vector (bit 0 of each byte): ``(first page, pages)``."""
    present = (flags & 1).astype(np.int8)
    edges = np.flatnonzero(np.diff(np.concatenate(([0], present, [0]))))
    return [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


class Populator:
    """Populates ``[base, base + size)`` (a read-only shared map, page-aligned) with the pages its file holds."""

    def __init__(self, base: int, size: int, *, chunk_bytes: int = CHUNK_BYTES, retry_s: float = RETRY_S) -> None:
        if base % PAGE or chunk_bytes % PAGE or chunk_bytes <= 0:
            raise ValueError(f"populate: base {base:#x} and chunk {chunk_bytes} must be whole pages")
        self.base = base
        self.size = size
        self.chunk_bytes = chunk_bytes
        self.retry_s = retry_s
        self.populated_bytes = 0  # pages mapped by this populator (not those a copy faulted in first)
        self.passes = 0
        self.state = "idle"  # idle | running | done | stopped | failed
        self.seconds = 0.0  # the thread's CPU time
        self._stop = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self.state = "running"
            self._thread = threading.Thread(target=self.run, name="hkvd-pool-populate", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the thread and wait for it (one call on a chunk at most). Idempotent."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        if self.state in ("idle", "running"):
            self.state = "stopped"
        self._done.set()

    def wait(self, timeout_s: float) -> bool:
        """Whether the thread ended (done, stopped or failed) within ``timeout_s`` (benches and tests)."""
        return self._done.wait(timeout_s)

    def run(self) -> None:
        """The thread's body (``start`` runs it); called directly, it populates on the caller's thread."""
        t0 = time.thread_time()
        try:
            self._passes()
        except Exception:  # a bug here must not reach the engine: its pages fault as they are read
            logger.exception("hkvd worker: populating the pool map failed; in-step copies fault its pages in")
            self.state = "failed"
        finally:
            self.seconds = time.thread_time() - t0
            self._done.set()

    def _passes(self) -> None:
        pending = list(range(0, self.size, self.chunk_bytes))
        flags = (ctypes.c_ubyte * (self.chunk_bytes // PAGE))()
        while pending and not self._stop.is_set():
            self.passes += 1
            before, left = self.populated_bytes, []
            for off in pending:
                if self._stop.is_set():
                    return
                n = min(self.chunk_bytes, self.size - off)
                whole = self._chunk(off, n, flags)
                if whole is None:
                    return
                if not whole:
                    left.append(off)
            pending = left
            if not pending or self.populated_bytes == before or self._stop.wait(self.retry_s):
                break
        if not self._stop.is_set():
            self.state = "done"
            logger.info("hkvd worker: mapped %.1f GiB of the pool map in %d pass(es) ahead of in-step copies%s",
                        self.populated_bytes / 2**30, self.passes,
                        "" if not pending else f"; {len(pending)} chunks of {self.chunk_bytes >> 20} MiB not all "
                        "resident (hugetlb, or not yet faulted by the daemon) fault their pages in when read")

    def _chunk(self, off: int, n: int, flags: ctypes.Array[ctypes.c_ubyte]) -> bool | None:
        """Populate the resident pages of one chunk: whether all of it was resident; None to end the thread."""
        addr = self.base + off
        if _mincore(addr, n, flags) != 0:
            self._failed("mincore")
            return None
        pages = -(-n // PAGE)
        runs = resident_runs(np.frombuffer(memoryview(flags), dtype=np.uint8, count=pages))
        for first, count in runs:
            if _madvise(addr + first * PAGE, min(count * PAGE, n - first * PAGE), MADV_POPULATE_READ) != 0:
                self._failed("madvise(MADV_POPULATE_READ)")
                return None
            self.populated_bytes += min(count * PAGE, n - first * PAGE)
        return sum(c for _, c in runs) == pages

    def _failed(self, call: str) -> None:
        err = ctypes.get_errno()
        if err == errno.EINVAL:
            logger.info("hkvd worker: %s is not supported here (Linux >= 5.14); in-step copies fault the pool "
                        "map's pages in as they read them", call)
        else:
            logger.warning("hkvd worker: %s on the pool map failed (%s); in-step copies fault the rest of its pages "
                           "in as they read them", call, os.strerror(err))
        self.state = "failed"
