"""Background pre-fault: superblocks are handed out only once faulted; errors stop it cleanly;
the backing and NUMA placement come from the kernel (smaps, numa_maps, mbind)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from hkvd.daemon.cache import backing
from hkvd.daemon.cache.pool import HugePagePool, SlabAllocator
from hkvd.daemon.cache.prefault import Prefaulter, default_threads, first_slice_bytes
from hkvd.transport.errors import PoolError

MIB = 1 << 20


def test_allocator_hands_out_only_admitted_superblocks() -> None:
    a = SlabAllocator(8 * MIB, 2 * MIB, admitted=False)
    assert a.alloc(4096) is None and a.statistics().admitted_bytes == 0
    a.admit(2, 1)
    a.admit(2, 1)  # idempotent
    got = a.alloc_many(MIB, 5)
    assert len(got) == 2 and all(a.superblock_of(e.pool_offset) == 2 for g in got for e in g.extents)
    assert a.statistics().admitted_bytes == 2 * MIB and a.statistics().superblocks_free == 0
    a.admit(0, 2)
    assert a.alloc(MIB) is not None and a.statistics().superblocks_free == 1
    for g in got:
        a.free(g)  # a freed superblock goes back to the free heap: it stays admitted
    assert a.statistics().superblocks_free == 2 and a.is_admitted(4 * MIB) and not a.is_admitted(6 * MIB)
    with pytest.raises(ValueError, match="outside"):
        a.admit(3, 2)


def test_prefaulter_admits_each_range_after_its_populate_in_order() -> None:
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    def populate(offset: int, n: int) -> None:
        with lock:
            events.append(("populate", offset // (2 * MIB)))

    def admit(first: int, count: int) -> None:
        with lock:
            events.append(("admit", first))

    pf = Prefaulter(populate, admit, capacity=16 * MIB, superblock_bytes=2 * MIB, page_size=4096, threads=3).start()
    p = pf.wait_for(16 * MIB, 30)
    pf.stop()
    assert p.faulted_bytes == 16 * MIB and pf.progress().done and not p.error
    for sb in range(8):
        assert events.index(("populate", sb)) < events.index(("admit", sb))
    assert sorted(e[1] for e in events if e[0] == "populate") == list(range(8))


def test_done_is_reported_only_after_on_done_ran() -> None:
    """Whoever sees ``done`` sees what the last worker did after the fill (the pool's backing,
    re-read there), and a failing hook is logged without turning the fill into an error."""
    release = threading.Event()
    ran = threading.Event()

    def on_done() -> None:
        ran.set()
        release.wait(30)
        raise RuntimeError("smaps unreadable")

    pf = Prefaulter(lambda o, n: None, lambda f, c: None, capacity=8 * MIB, superblock_bytes=2 * MIB,
                    page_size=4096, threads=2, on_done=on_done).start()
    assert ran.wait(30)
    p = pf.wait_for(8 * MIB, 0.05)
    assert p.faulted_bytes == 8 * MIB and not p.done  # every range is in, the hook still runs
    assert not pf.wait_for(16 * MIB, 0.05).done
    release.set()
    p = pf.wait_for(16 * MIB, 30)
    pf.stop()
    assert p.done and not p.error


def test_pool_status_after_prefault_shows_the_backing_of_the_whole_pool() -> None:
    with HugePagePool(16 * MIB, "off", superblock_bytes=2 * MIB, faulted_only=True) as p:
        assert p.backing().resident_bytes == 0  # observed (and cached) before any fault
        pf = p.start_prefault(2)
        assert pf.wait_for(pf.total_bytes, 30).faulted_bytes == 16 * MIB
        pf.stop()  # returns once the workers exited: the last one re-read the backing first
        assert pf.progress().done and p.backing().resident_bytes == 16 * MIB


def test_one_gib_pages_populate_whole_pages() -> None:
    ranges: list[tuple[int, int]] = []
    pf = Prefaulter(lambda o, n: ranges.append((o, n)), lambda f, c: None, capacity=2 << 30,
                    superblock_bytes=32 * MIB, page_size=1 << 30, threads=1).start()
    pf.wait_for(2 << 30, 30)
    pf.stop()
    assert ranges == [(0, 1 << 30), (1 << 30, 1 << 30)]


def test_populate_error_stops_the_fill_and_keeps_what_was_faulted() -> None:
    with HugePagePool(16 * MIB, "off", superblock_bytes=2 * MIB, faulted_only=True) as p:
        real = p.populate

        def failing(start: int, n: int) -> None:
            if start >= 6 * MIB:
                raise PoolError(f"populate failed at {start}")
            real(start, n)

        p.populate = failing  # type: ignore[method-assign]
        with pytest.raises(PoolError, match="populate failed"):
            p.prefault(threads=1)
        stats = p.allocator.statistics()
        assert stats.admitted_bytes == 6 * MIB and p.prefaulter is not None
        assert p.prefaulter.progress().error.startswith("populate failed")
        assert len(p.alloc_many(2 * MIB, 10)) == 3  # only the faulted superblocks are handed out


def test_populate_lets_the_event_loop_run_while_it_faults() -> None:
    """A background populate drops the GIL while the kernel faults pages in: the daemon's event loop
    (here, this thread) keeps running instead of stalling for the whole fault."""
    ticks = 0
    during: list[int] = []
    done = threading.Event()
    with HugePagePool(64 * MIB, "off", superblock_bytes=16 * MIB, faulted_only=True) as p:

        def fault() -> None:
            before = ticks
            p.populate(0, p.size)
            during.append(ticks - before)
            done.set()

        interval = sys.getswitchinterval()
        sys.setswitchinterval(60.0)  # the GIL changes hands only where a thread drops it itself
        try:
            t = threading.Thread(target=fault)
            t.start()
            while not done.is_set():
                ticks += 1
                time.sleep(0)  # drops the GIL: the populate thread can start, and finish
        finally:
            sys.setswitchinterval(interval)
        t.join(30)
    assert during and during[0] > 0, "this thread never ran while the populate faulted 64 MiB in"


def test_close_stops_a_running_prefault() -> None:
    gate = threading.Event()
    p = HugePagePool(16 * MIB, "off", superblock_bytes=2 * MIB, faulted_only=True)
    real = p.populate

    def slow(start: int, n: int) -> None:
        gate.wait(30) if start >= 4 * MIB else None
        real(start, n)

    p.populate = slow  # type: ignore[method-assign]
    pf = p.start_prefault(2)
    assert pf.wait_for(4 * MIB, 30).faulted_bytes >= 4 * MIB
    assert not pf.progress().done
    gate.set()
    p.close()  # joins the workers before unmapping
    assert pf.progress().done and p.closed


def test_first_slice_and_default_threads() -> None:
    assert first_slice_bytes(64 * MIB, 2 * MIB) == 8 * MIB
    assert first_slice_bytes(1 << 40, 32 * MIB) == 256 * MIB
    assert first_slice_bytes(2 * MIB, 2 * MIB) == 2 * MIB
    assert 1 <= default_threads() <= 8


def test_backing_reads_plain_pages_from_smaps() -> None:
    with HugePagePool(8 * MIB, "off", superblock_bytes=2 * MIB, faulted_only=True) as p:
        p.prefault()
        b = p.backing(refresh=True)
        assert (b.kind, b.page_size, b.huge_bytes) == ("plain", 4096, 0)
        assert b.resident_bytes == 8 * MIB and sum(b.node_bytes.values()) == 8 * MIB


@pytest.mark.out_of_process  # binding finds libnuma through ctypes.util.find_library, which runs ldconfig
def test_numa_bind_to_node_zero_and_refuse_a_node_without_memory() -> None:
    nodes = backing.memory_nodes()
    with HugePagePool(8 * MIB, "off", superblock_bytes=2 * MIB, faulted_only=True, numa_node=nodes[0]) as p:
        p.prefault()
        b = p.backing(refresh=True)
        assert b.numa_policy == f"bind:{nodes[0]}" and b.node_bytes == {nodes[0]: 8 * MIB}
        assert p.statistics().numa_node == nodes[0]
    missing = max(nodes) + 1
    with pytest.raises(PoolError, match=rf"--numa-node {missing}: this machine has memory on NUMA node\(s\)"):
        HugePagePool(8 * MIB, "off", superblock_bytes=2 * MIB, faulted_only=True, numa_node=missing)


def test_memory_nodes_parses_ranges(tmp_path: Path) -> None:
    (tmp_path / "has_memory").write_text("0-2,5\n")
    assert backing.memory_nodes(str(tmp_path)) == [0, 1, 2, 5]
    assert backing.memory_nodes(str(tmp_path / "none")) == [0]
