"""Copy descriptors: the pure arithmetic between ``Segment`` lists and GPU launches.

Role
    Turns the daemon's segments (region id, offset in region, offset in pool, length) into a
    packed ``int64`` array of ``(src_ptr, dst_ptr, nbytes)`` rows that the gather/scatter
    kernel (``hkvd.cuda.copy``) reads, or that the memcpy path walks one row per
    ``cudaMemcpyAsync``. Also the launch geometry of that kernel. Nothing here touches CUDA,
    so every line is tested on CPU (``tests/gpu/test_cuda_cpu.py``), including against what
    the host copy engine moves for the same layouts.

Threading
    Pure functions over immutable inputs; safe from any thread.

Contracts
    - ``build_descriptors`` checks every segment against its region size and the pool size
      *before* producing any row (defence in depth: the caller already checked) and raises
      ``CopyFailedError`` naming the first offending segment, like the host engine does.
    - Row ``i`` of the result moves ``segments[i]`` (zero-length segments are dropped); for
      ``Direction.TO_POOL`` the source is the engine side, for ``FROM_POOL`` the pool side.
    - Addresses are absolute: engine side = ``region_bases[region_id] + region_offset``, pool
      side = ``pool_base + pool_offset``. Both must fit in a signed 64-bit integer (device and
      host virtual addresses on x86-64 and aarch64 stay below 2**57).
    - A pool pinned in chunks (``hkvd.cuda.hostreg``): ``split_at`` (or ``coalesce`` given the
      chunk boundaries) cuts rows so that none spans two registrations.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from hkvd.transport.copy_engine import Direction, Segment
from hkvd.transport.errors import CopyFailedError

# One kernel block copies at most this many bytes of one segment per grid-stride step. 64 KiB
# = 256 threads x 16 B x 16 iterations: small enough that an 8 MiB page is spread over 128
# blocks (one SM's copy bandwidth, ~10-20 GB/s over PCIe, would otherwise cap a big page),
# large enough that the per-block setup is amortised. bench/gpu_copy.py sweeps it.
DEFAULT_CHUNK_BYTES = 64 << 10
MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y
MAX_GRID_X = (1 << 31) - 1  # CUDA's limit on gridDim.x
_INT64_MAX = (1 << 63) - 1

SRC, DST, LEN = 0, 1, 2  # column indices of a descriptor row


class LaunchGeometry(NamedTuple):
    grid_x: int  # one block column per descriptor row
    grid_y: int  # blocks sharing one row, each striding over chunk_bytes pieces of it
    chunk_bytes: int


def empty_descriptors() -> np.ndarray:
    return np.empty((0, 3), dtype=np.int64)


def build_descriptors(
    segments: Sequence[Segment],
    direction: Direction,
    *,
    region_bases: Mapping[int, int],
    region_sizes: Mapping[int, int],
    pool_base: int,
    pool_size: int,
) -> np.ndarray:
    """Return a C-contiguous ``(n, 3)`` int64 array of ``(src, dst, nbytes)``. See the module docstring.

    ``region_bases`` maps region id -> the address of the region's byte 0 in *this* process (for
    CUDA: opened IPC pointer + ``Region.offset``); ``region_sizes`` maps region id -> its size.
    """
    n = len(segments)
    if n == 0:
        return empty_descriptors()
    rid = np.fromiter((s.region_id for s in segments), dtype=np.int64, count=n)
    roff = np.fromiter((s.region_offset for s in segments), dtype=np.int64, count=n)
    poff = np.fromiter((s.pool_offset for s in segments), dtype=np.int64, count=n)
    size = np.fromiter((s.nbytes for s in segments), dtype=np.int64, count=n)

    known = set(region_bases) & set(region_sizes)
    for i, r in enumerate(rid.tolist()):
        if r not in known:
            raise CopyFailedError(f"segment {i} names region {r}, which is not registered")
    ids = sorted(known)
    lut = np.searchsorted(np.asarray(ids, dtype=np.int64), rid)
    bases = np.asarray([region_bases[r] for r in ids], dtype=np.int64)[lut]
    sizes = np.asarray([region_sizes[r] for r in ids], dtype=np.int64)[lut]

    bad = (size < 0) | (roff < 0) | (roff > sizes - size) | (poff < 0) | (poff > pool_size - size)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        s = segments[i]
        if s.nbytes < 0 or s.region_offset < 0 or s.region_offset + s.nbytes > region_sizes[s.region_id]:
            raise CopyFailedError(
                f"segment {i} [{s.region_offset}, +{s.nbytes}) leaves region {s.region_id} "
                f"({region_sizes[s.region_id]} bytes)"
            )
        raise CopyFailedError(
            f"segment {i} [{s.pool_offset}, +{s.nbytes}) leaves the pool ({pool_size} bytes)"
        )
    if pool_base < 0 or pool_base + pool_size > _INT64_MAX or min(region_bases.values()) < 0:
        raise CopyFailedError("an address does not fit in int64 (pool or region base)")

    engine = bases + roff
    pool = np.int64(pool_base) + poff
    out = np.empty((n, 3), dtype=np.int64)
    if direction is Direction.TO_POOL:
        out[:, SRC], out[:, DST] = engine, pool
    else:
        out[:, SRC], out[:, DST] = pool, engine
    out[:, LEN] = size
    keep = size > 0
    return out if keep.all() else np.ascontiguousarray(out[keep])


def coalesce(desc: np.ndarray, direction: Direction | None = None, *, pool_base: int = 0,
             boundaries: Sequence[int] = ()) -> np.ndarray:
    """Merge consecutive rows that are contiguous on *both* sides. Bytes moved are unchanged.

    ``segments_for_entry`` already merges within one entry; this also merges across entries of
    one batch (consecutive pool extents of block-major engines), which turns thousands of
    ``cudaMemcpyAsync`` calls (~2-4 us of CPU each) into a few. With ``boundaries`` (and the
    ``direction`` and ``pool_base`` that place the pool side), no resulting row crosses one
    (``split_at``): a pool pinned in several registrations is never copied across two at once.
    """
    merged = _merge(desc)
    if len(boundaries):
        if direction is None:
            raise ValueError("coalesce with boundaries needs the direction (which side is the pool)")
        return split_at(merged, direction, pool_base=pool_base, boundaries=boundaries)
    return merged


def _merge(desc: np.ndarray) -> np.ndarray:
    n = desc.shape[0]
    if n < 2:
        return desc
    src, dst, ln = desc[:, SRC], desc[:, DST], desc[:, LEN]
    joins = (src[:-1] + ln[:-1] == src[1:]) & (dst[:-1] + ln[:-1] == dst[1:])
    if not joins.any():
        return desc
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    out = np.empty((starts.size, 3), dtype=np.int64)
    out[:, SRC] = src[starts]
    out[:, DST] = dst[starts]
    out[:, LEN] = np.add.reduceat(ln, starts)
    return out


def split_at(desc: np.ndarray, direction: Direction, *, pool_base: int, boundaries: Sequence[int]) -> np.ndarray:
    """Cut every row whose pool side spans a boundary, so no row crosses one. Bytes moved are unchanged.

    ``boundaries``: pool offsets, ascending, where one pinned registration ends and the next begins
    (``hkvd.cuda.hostreg.PinnedRegistration.boundaries``): a DMA copy must not span two. The pool side is
    the destination of a ``TO_POOL`` row and the source of a ``FROM_POOL`` one. Apply after ``coalesce``
    (which may join rows across a boundary); rows are returned in order, pieces of a row in address order.
    """
    n = desc.shape[0]
    if n == 0 or not len(boundaries):
        return desc
    bounds = np.asarray(boundaries, dtype=np.int64)
    if (np.diff(bounds) <= 0).any():
        raise ValueError("boundaries must be strictly ascending pool offsets")
    col = DST if direction is Direction.TO_POOL else SRC
    start = desc[:, col] - np.int64(pool_base)  # pool offsets of each row's pool side
    end = start + desc[:, LEN]
    lo = np.searchsorted(bounds, start, side="right")  # first boundary past the row's start
    hi = np.searchsorted(bounds, end, side="left")  # boundaries strictly inside the row: [lo, hi)
    cuts = hi - lo
    if not cuts.any():
        return desc
    pieces = cuts + 1
    row = np.repeat(np.arange(n), pieces)
    j = np.arange(row.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # piece index within its row
    inner = bounds[np.minimum(lo[row] + j - 1, bounds.size - 1)]  # the boundary a piece j >= 1 starts at
    p_start = np.where(j == 0, start[row], inner)
    last = j == cuts[row]
    p_end = np.where(last, end[row], bounds[np.minimum(lo[row] + j, bounds.size - 1)])
    shift = p_start - start[row]
    out = np.empty((row.size, 3), dtype=np.int64)
    out[:, SRC] = desc[row, SRC] + shift
    out[:, DST] = desc[row, DST] + shift
    out[:, LEN] = p_end - p_start
    return out


def launch_geometry(desc: np.ndarray, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> LaunchGeometry:
    """Grid for the gather/scatter kernel: x = rows, y = chunks of the longest row (capped).

    Rows shorter than the longest leave some y-blocks idle (they return at once); the kernel
    grid-strides over y, so the cap on ``grid_y`` only lowers parallelism, never coverage.
    """
    if chunk_bytes <= 0 or chunk_bytes % 16:
        raise ValueError(f"chunk_bytes must be a positive multiple of 16, got {chunk_bytes}")
    n = int(desc.shape[0])
    if n > MAX_GRID_X:
        raise ValueError(f"{n} descriptors exceed one launch ({MAX_GRID_X}); split the batch")
    if n == 0:
        return LaunchGeometry(0, 0, chunk_bytes)
    longest = int(desc[:, LEN].max())
    grid_y = max(1, min(MAX_GRID_Y, -(-longest // chunk_bytes)))
    return LaunchGeometry(n, grid_y, chunk_bytes)


def total_bytes(desc: np.ndarray) -> int:
    return int(desc[:, LEN].sum()) if desc.shape[0] else 0
