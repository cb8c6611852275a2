"""Page tables for an engine's pool map (``hkvd.shim.map_populator``): a memfd pool mapped read-only as an engine
maps its daemon's pool; what the populator maps is read back from this process's smaps (``Rss`` of the map)."""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading

import numpy as np
import pytest

from hkvd.shim import map_populator
from hkvd.shim.map_populator import PAGE, Populator, resident_runs
from hkvd.shim.pool_reads import PoolMaps

CHUNK = 16 * PAGE
POOL = 4 * CHUNK


def _rss(addr: int) -> int:
    """Bytes of the mapping at ``addr`` this process has page tables for."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            key, sep, rest = line.partition(":")
            if not sep or " " in key:
                inside = line.startswith(f"{addr:x}-")
            elif inside and key == "Rss":
                return int(rest.split()[0]) * 1024
    raise AssertionError(f"no mapping at {addr:#x}")


@pytest.fixture
def half_pool() -> tuple[int, int]:
    """A memfd whose first half holds pages (the daemon faulted them) and whose second half is a hole."""
    fd = os.memfd_create("hkvd-test-populate", os.MFD_CLOEXEC)
    os.ftruncate(fd, POOL)
    os.pwrite(fd, b"\x07" * (POOL // 2), 0)
    yield fd, os.fstat(fd).st_blocks
    os.close(fd)


def _map(fd: int) -> tuple[mmap.mmap, np.ndarray, int]:
    mm = mmap.mmap(fd, POOL, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    view = np.frombuffer(mm, dtype=np.uint8)
    return mm, view, int(view.ctypes.data)


@pytest.mark.fast
def test_resident_runs_are_the_runs_of_bit_zero() -> None:
    assert resident_runs(np.array([1, 1, 0, 0, 1, 0, 1, 1], dtype=np.uint8)) == [(0, 2), (4, 1), (6, 2)]
    assert resident_runs(np.array([0, 2, 0], dtype=np.uint8)) == []  # only bit 0 says resident
    assert resident_runs(np.array([3], dtype=np.uint8)) == [(0, 1)]
    assert resident_runs(np.zeros(0, dtype=np.uint8)) == []


@pytest.mark.fast
def test_only_the_pages_the_pool_holds_are_mapped_and_a_hole_is_not_allocated(half_pool) -> None:
    fd, blocks = half_pool
    mm, view, base = _map(fd)
    assert _rss(base) == 0  # a fresh map: every first read would fault
    pop = Populator(base, POOL, chunk_bytes=CHUNK, retry_s=0.0)

    pop.run()

    assert pop.state == "done" and pop.populated_bytes == POOL // 2
    assert pop.passes == 2  # the second pass found nothing new in the hole and ended
    assert _rss(base) == POOL // 2
    assert os.fstat(fd).st_blocks == blocks  # the hole was not allocated through the engine's map
    del view
    mm.close()


@pytest.mark.fast
def test_pages_the_daemon_faults_after_a_pass_are_mapped_by_the_next(half_pool) -> None:
    fd, _ = half_pool
    mm, view, base = _map(fd)
    pop = Populator(base, POOL, chunk_bytes=CHUNK, retry_s=0.0)

    class PrefaultBetweenPasses:  # stands in for the stop event: the daemon pre-faults the rest meanwhile
        def is_set(self) -> bool:
            return False

        def wait(self, timeout_s: float) -> bool:
            os.pwrite(fd, b"\x07" * (POOL // 2), POOL // 2)
            return False

    pop._stop = PrefaultBetweenPasses()  # type: ignore[assignment]
    pop.run()

    assert pop.state == "done" and pop.passes == 2 and pop.populated_bytes == POOL
    assert _rss(base) == POOL
    del view
    mm.close()


@pytest.mark.fast
def test_a_kernel_without_populate_read_ends_the_populator_and_copies_still_read_the_map(
        half_pool, monkeypatch, caplog) -> None:
    fd, _ = half_pool

    def no_populate_read(addr: int, n: int, advice: int) -> int:
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(map_populator, "_madvise", no_populate_read)
    caplog.set_level(logging.INFO, logger="hkvd.shim")
    maps = PoolMaps()
    maps.map(os.getpid(), "d", [fd, POOL])
    pool = maps.get("d")
    assert pool is not None and pool.populator is not None
    assert pool.populator.wait(30.0)

    assert pool.populator.state == "failed" and pool.populator.populated_bytes == 0
    assert "not supported here" in caplog.text
    assert int(pool.view[:PAGE].sum()) == 7 * PAGE  # the map reads as before: its pages fault in
    maps.close()


@pytest.mark.fast
def test_a_map_closed_while_populating_stops_and_joins_its_populator_first(half_pool, monkeypatch) -> None:
    fd, _ = half_pool
    entered, release = threading.Event(), threading.Event()
    real = map_populator._madvise

    def held_madvise(addr: int, n: int, advice: int) -> int:
        entered.set()
        release.wait(30.0)
        return real(addr, n, advice)

    monkeypatch.setattr(map_populator, "_madvise", held_madvise)
    maps = PoolMaps()
    maps.map(os.getpid(), "d", [fd, POOL])
    pool = maps.get("d")
    assert pool is not None and pool.populator is not None
    populator = pool.populator
    assert entered.wait(30.0)  # the thread is inside a call on the map
    closer = threading.Thread(target=maps.close)
    closer.start()
    assert not populator.wait(0.05) and not pool.mm.closed  # close() waits for the call on the map to end
    release.set()
    closer.join(30.0)

    assert not closer.is_alive()
    assert populator.state == "stopped"
    assert pool.mm.closed
