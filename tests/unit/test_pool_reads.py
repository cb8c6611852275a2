"""In-step loads' copies (``hkvd.shim.pool_reads``): a pool shared through a memfd, mapped read-only through
/proc/<pid>/fd/<n> as an engine maps its daemon's pool, copied into engine memory by the layout's segments.

The daemon's process is this one (the memfd is this test's); the engine's memory is a NumPy buffer.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from hkvd.shim.pool_reads import PoolMaps, copy_in_step, slice_extents
from hkvd.transport import layout
from hkvd.transport.copy_engine import Region
from hkvd.transport.wire.kv import Item

PAGE = 256
BLOCKS = 8
LAYERS = 2
POOL = 1 << 16


def _group(gid: int, kind: str, region: int, offset: int) -> layout.GroupSpec:
    # Layer-major: layer l, block b at offset + l * BLOCKS * PAGE + b * PAGE.
    view = layout.View(region, offset, LAYERS, BLOCKS * PAGE, PAGE, PAGE)
    return layout.GroupSpec(gid, kind, 16, 32 if kind == "swa" else 0, BLOCKS, "bfloat16", (view,))


@pytest.fixture
def pool() -> tuple[int, np.ndarray]:
    fd = os.memfd_create("hkvd-test-pool", os.MFD_CLOEXEC)
    os.ftruncate(fd, POOL)
    data = np.random.default_rng(7).integers(0, 256, POOL, dtype=np.uint8)
    os.pwrite(fd, data.tobytes(), 0)
    yield fd, data
    os.close(fd)


@pytest.mark.fast
def test_a_mapped_pool_copies_each_entry_into_its_blocks_and_skips_a_windows_null_blocks(pool) -> None:
    fd, data = pool
    maps = PoolMaps()
    assert maps.map(os.getpid(), "daemon-a", [fd, POOL]) == "daemon-a"
    mapped = maps.get("daemon-a")
    assert mapped is not None and mapped.size == POOL
    engine = np.zeros(2 * LAYERS * BLOCKS * PAGE, dtype=np.uint8)
    regions = {0: Region(0, "host", engine.nbytes, int(engine.ctypes.data))}
    full, swa = _group(0, "full", 0, 0), _group(1, "swa", 0, LAYERS * BLOCKS * PAGE)
    entry = 2 * LAYERS * PAGE  # two blocks per entry, every layer
    places = {(0, 0): [0, entry], (1, 0): [8192, 512, 4096, entry - 512]}  # the second entry in two extents
    items = [Item(0, 0, b"k" * 16, [3, 5]), Item(1, 0, b"k" * 16, [0, 6])]  # the window nulled block 0 of it

    moved = copy_in_step(mapped, items, places, {0: full, 1: swa}, regions)

    assert moved == entry + entry // 2
    logical_swa = np.concatenate([data[8192:8192 + 512], data[4096:4096 + entry - 512]])
    for layer in range(LAYERS):
        for k, block in enumerate((3, 5)):  # entry order: block, then layer
            src = data[(k * LAYERS + layer) * PAGE:][:PAGE]
            dst = engine[layer * BLOCKS * PAGE + block * PAGE:][:PAGE]
            assert np.array_equal(dst, src)
        src = logical_swa[(1 * LAYERS + layer) * PAGE:][:PAGE]  # the swa entry's second block
        dst = engine[LAYERS * BLOCKS * PAGE + layer * BLOCKS * PAGE + 6 * PAGE:][:PAGE]
        assert np.array_equal(dst, src)
    untouched = np.ones(engine.nbytes, dtype=bool)
    for layer in range(LAYERS):
        for base, block in ((0, 3), (0, 5), (LAYERS * BLOCKS * PAGE, 6)):
            untouched[base + layer * BLOCKS * PAGE + block * PAGE:][:PAGE] = False
    assert not engine[untouched].any()  # nothing else written: not the null block's place, not the others
    maps.close()


@pytest.mark.fast
def test_a_place_out_of_the_pool_or_a_null_state_block_is_refused_before_any_byte_moves(pool) -> None:
    fd, _ = pool
    maps = PoolMaps()
    maps.map(os.getpid(), "d", [fd, POOL])
    mapped = maps.get("d")
    assert mapped is not None
    engine = np.zeros(2 * LAYERS * BLOCKS * PAGE, dtype=np.uint8)
    regions = {0: Region(0, "host", engine.nbytes, int(engine.ctypes.data))}
    full, mamba = _group(0, "full", 0, 0), _group(2, "mamba", 0, LAYERS * BLOCKS * PAGE)
    entry = 2 * LAYERS * PAGE
    with pytest.raises(ValueError, match="out of bounds"):
        copy_in_step(mapped, [Item(0, 0, b"k" * 16, [1, 2])], {(0, 0): [POOL - entry // 2, entry]}, {0: full},
                     regions)
    with pytest.raises(ValueError, match="null block"):
        copy_in_step(mapped, [Item(2, 0, b"k" * 16, [0])], {(2, 0): [0, LAYERS * PAGE]}, {2: mamba}, regions)
    with pytest.raises(ValueError, match="no pool place"):
        copy_in_step(mapped, [Item(0, 1, b"k" * 16, [1, 2])], {}, {0: full}, regions)
    assert not engine.any()
    maps.close()


@pytest.mark.fast
def test_a_pool_that_cannot_be_opened_is_said_once_and_not_mapped(caplog) -> None:
    maps = PoolMaps()
    assert maps.map(os.getpid(), "d", [987654, POOL]) == ""
    assert maps.map(os.getpid(), "d", [987654, POOL]) == ""
    assert maps.map(os.getpid(), "", []) == ""  # not offered
    assert caplog.text.count("cannot map the daemon's pool") == 1
    assert maps.get("d") is None


@pytest.mark.fast
def test_only_the_last_two_pools_stay_mapped(pool) -> None:
    fd, _ = pool
    maps = PoolMaps()
    for sid in ("a", "b", "c"):
        maps.map(os.getpid(), sid, [fd, POOL])
    assert maps.get("a") is None and maps.get("b") is not None and maps.get("c") is not None
    maps.close()


@pytest.mark.fast
def test_slice_extents_follows_the_logical_order_across_extents() -> None:
    ext = [(100, 10), (500, 5), (0, 20)]
    assert slice_extents(ext, 0, 10) == [(100, 10)]
    assert slice_extents(ext, 8, 10) == [(108, 2), (500, 5), (0, 3)]
    assert slice_extents(ext, 15, 20) == [(0, 20)]
    with pytest.raises(ValueError):
        slice_extents(ext, 30, 10)
