"""A pool pinned in several registrations (drivers cap one ``cudaHostRegister`` at 512 GiB), on CPU.

The CUDA runtime is replaced at its boundary by a stand-in that records ``hostRegister`` /
``hostUnregister``; the registration cap is lowered so a small real mapping takes three chunks.
Copies across chunk boundaries are built into descriptors, coalesced with the boundaries, checked
row by row (none spans two registrations), and executed with ``memmove`` exactly as the kernel and
the DMA path read them: the bytes must come out exact.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import random
from collections.abc import Iterator

import numpy as np
import pytest

from hkvd.cuda import hostreg
from hkvd.cuda.descriptors import DST, LEN, SRC, build_descriptors, coalesce, split_at, total_bytes
from hkvd.cuda.hostreg import PinnedRegistration, chunk_spans
from hkvd.transport.copy_engine import Direction, Segment

CAP = 64 << 10  # the lowered cap: 64 KiB per registration
POOL = 2 * CAP + (32 << 10)  # three chunks: 64 + 64 + 32 KiB


class _Runtime:
    """``hostRegister`` / ``hostUnregister`` recorded; ``fail_at``: the call (1-based) that raises."""

    def __init__(self, fail_at: int = 0) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []
        self.fail_at = fail_at

    def hostRegister(self, addr: int, size: int, flags: int) -> None:
        self.calls.append(("register", addr, size))
        if len([c for c in self.calls if c[0] == "register"]) == self.fail_at:
            raise RuntimeError("cudaErrorInvalidValue")
        assert flags == hostreg.POOL_REGISTER_FLAGS
        for a, n in self.registered.items():  # a range is registered at most once
            assert addr + size <= a or a + n <= addr, "overlapping registrations"
        self.registered[addr] = size

    def hostUnregister(self, addr: int) -> None:
        self.calls.append(("unregister", addr, self.registered.pop(addr)))


class _Cupy:
    class cuda:
        @staticmethod
        @contextlib.contextmanager
        def Device(i: int) -> Iterator[None]:
            yield


@pytest.fixture
def pool() -> Iterator[np.ndarray]:
    yield np.frombuffer(mmap.mmap(-1, POOL), dtype=np.uint8)  # page-aligned, like the pool; unmapped when collected


def _stand_in(monkeypatch: pytest.MonkeyPatch, rt: _Runtime) -> None:
    monkeypatch.setattr(hostreg, "runtime", lambda: rt)
    monkeypatch.setattr(hostreg, "cupy", lambda: _Cupy)
    monkeypatch.setattr(hostreg, "MAX_REGISTER_BYTES", CAP)


def test_the_pool_is_registered_in_capped_chunks_and_each_is_unregistered(monkeypatch: pytest.MonkeyPatch,
                                                                          pool: np.ndarray) -> None:
    rt = _Runtime()
    _stand_in(monkeypatch, rt)
    base = pool.ctypes.data

    class _Pool:
        base_addr = base
        size = POOL

    reg = PinnedRegistration.for_pool(_Pool())
    assert rt.calls == [("register", base, CAP), ("register", base + CAP, CAP),
                        ("register", base + 2 * CAP, POOL - 2 * CAP)]
    assert reg.boundaries == (CAP, 2 * CAP) and reg.chunks == 3 and reg.registered
    reg.close()
    reg.close()  # idempotent
    assert [c for c in rt.calls if c[0] == "unregister"] == [("unregister", base + 2 * CAP, POOL - 2 * CAP),
                                                             ("unregister", base + CAP, CAP),
                                                             ("unregister", base, CAP)]
    assert rt.registered == {} and not reg.registered
    # The default cap: one registration up to 512 GiB, two just past it.
    assert chunk_spans(1 << 21, 1 << 39) == [(1 << 21, 1 << 39)]
    assert [n for _, n in chunk_spans(1 << 21, (1 << 39) + (2 << 20))] == [1 << 39, 2 << 20]
    with pytest.raises(ValueError, match="multiple of 4096"):
        chunk_spans(1 << 21, 1 << 20, 1000)


def test_a_registration_failing_midway_undoes_the_chunks_before_it(monkeypatch: pytest.MonkeyPatch,
                                                                    pool: np.ndarray) -> None:
    rt = _Runtime(fail_at=2)
    _stand_in(monkeypatch, rt)
    base = pool.ctypes.data
    with pytest.raises(RuntimeError, match=r"chunk 2 of 3 .*--cuda-pin-chunk-gib"):
        PinnedRegistration(base, POOL, max_chunk_bytes=CAP)
    assert rt.calls == [("register", base, CAP), ("register", base + CAP, CAP), ("unregister", base, CAP)]
    assert rt.registered == {}


def _crosses(desc: np.ndarray, direction: Direction, base: int, bounds: tuple[int, ...]) -> list[int]:
    col = DST if direction is Direction.TO_POOL else SRC
    start = desc[:, col] - base
    end = start + desc[:, LEN]
    return [i for i in range(desc.shape[0]) if any(s < b < e for b in bounds for s, e in [(start[i], end[i])])]


def _execute(desc: np.ndarray) -> None:
    for src, dst, n in desc.tolist():
        ctypes.memmove(dst, src, n)


@pytest.mark.parametrize("direction", [Direction.TO_POOL, Direction.FROM_POOL])
def test_copies_across_chunk_boundaries_are_exact_and_no_row_spans_two(direction: Direction,
                                                                        pool: np.ndarray) -> None:
    rng = random.Random(36)
    bounds = (CAP, 2 * CAP)
    engine = np.frombuffer(rng.randbytes(POOL), dtype=np.uint8).copy()
    pool[:] = np.frombuffer(rng.randbytes(POOL), dtype=np.uint8)
    # One region that mirrors the pool's offsets: adjacent segments coalesce into one row spanning
    # every chunk; others straddle one boundary, start or end right on one, or sit inside a chunk.
    segs = [Segment(0, o, o, n) for o, n in [(0, 4096), (4096, CAP), (CAP + 4096, CAP)]]  # one run of 0..2CAP+4K
    segs += [Segment(0, o, o, n) for o, n in [(2 * CAP + 8192, 4096), (2 * CAP + 12288, 8192)]]  # inside the last
    for _ in range(30):  # random rows around a boundary, most straddling it (overlaps apply in order)
        n = rng.randrange(1, 6000)
        b = rng.choice(bounds)
        o = b - rng.randrange(0, n + 1)
        segs.append(Segment(1, o, o, n))
    region_bases = {0: engine.ctypes.data, 1: engine.ctypes.data}
    expect_pool, expect_engine = pool.copy(), engine.copy()
    for s in segs:  # the reference: what each segment moves, in order
        if direction is Direction.TO_POOL:
            expect_pool[s.pool_offset:s.pool_offset + s.nbytes] = expect_engine[s.region_offset:
                                                                                s.region_offset + s.nbytes]
        else:
            expect_engine[s.region_offset:s.region_offset + s.nbytes] = expect_pool[s.pool_offset:
                                                                                    s.pool_offset + s.nbytes]
    base = pool.ctypes.data
    desc = build_descriptors(segs, direction, region_bases=region_bases, region_sizes={0: POOL, 1: POOL},
                             pool_base=base, pool_size=POOL)
    merged = coalesce(desc)
    assert _crosses(merged, direction, base, bounds), "the layout must have rows that cross a boundary"
    out = coalesce(desc, direction, pool_base=base, boundaries=bounds)
    assert _crosses(out, direction, base, bounds) == []
    assert total_bytes(out) == total_bytes(desc)
    # The run over [0, 2 CAP + 4 KiB) is one row per chunk; the two adjacent ones in the last chunk, one row.
    assert out[:4, LEN].tolist() == [CAP, CAP, 4096, 12288]
    _execute(out)
    assert np.array_equal(pool, expect_pool) and np.array_equal(engine, expect_engine)


def test_split_at_cuts_one_row_over_every_boundary_in_address_order() -> None:
    base = 1 << 30
    desc = np.array([[7 << 20, base + 100, 3 * CAP]], dtype=np.int64)  # TO_POOL: pool side is DST
    out = split_at(desc, Direction.TO_POOL, pool_base=base, boundaries=(CAP, 2 * CAP, 3 * CAP))
    assert out.tolist() == [[7 << 20, base + 100, CAP - 100],
                            [(7 << 20) + CAP - 100, base + CAP, CAP],
                            [(7 << 20) + 2 * CAP - 100, base + 2 * CAP, CAP],
                            [(7 << 20) + 3 * CAP - 100, base + 3 * CAP, 100]]
    # Rows that start or end on a boundary are not cut; no boundary, no change.
    edge = np.array([[base + CAP, 5 << 20, CAP]], dtype=np.int64)  # FROM_POOL: pool side is SRC
    assert split_at(edge, Direction.FROM_POOL, pool_base=base, boundaries=(CAP, 2 * CAP)) is edge
    assert split_at(desc, Direction.TO_POOL, pool_base=base, boundaries=()) is desc
    with pytest.raises(ValueError, match="ascending"):
        split_at(desc, Direction.TO_POOL, pool_base=base, boundaries=(2 * CAP, CAP))
