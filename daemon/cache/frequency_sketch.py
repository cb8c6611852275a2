"""How often a chunk was asked for lately: a count-min sketch behind a doorkeeper, halved as it ages.

Role
    The frequency estimate of TinyLFU admission (``daemon/cache/admission.py``). ``add`` counts sightings of
    keys given as 64-bit hashes; ``estimate`` says about how many times one was seen since the counts were
    last halved: never fewer (count-min: a key's count is the least of its ``ROWS`` counters, which
    collisions can only raise). The doorkeeper, one bit per slot in front of the counters, takes a key's
    first sighting, so the keys seen once (most chunks of one-shot prompts) leave the counters alone;
    ``mark`` sets only the doorkeeper (a first sighting that is never counted twice). Every ``period``
    sightings the counters are halved and the doorkeeper cleared: a chunk popular an hour ago does not
    outweigh one popular now. Counters stop at ``CAP`` (four bits' worth, as in TinyLFU): admission only
    compares two of them.

    The structure is TinyLFU's (Einziger, Friedman and Manes, "TinyLFU: A Highly Efficient Cache Admission
    Policy", ACM Transactions on Storage, 2017). No maintained Python package on PyPI offers it over
    NumPy arrays for keys we have already hashed, so this small one is ours (``tests/unit/test_admission.py``).

Cost
    ``ROWS`` bytes per slot of ``width`` plus ``DOOR_BITS`` per slot of doorkeeper (NumPy arrays); an ``add``
    of n keys is a few vectorised NumPy operations, an ``estimate`` a few dict-free index computations.

Threading
    Event-loop only, like the index.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import xxhash

ROWS = 4
CAP = 15
DOOR_BITS = 4  # doorkeeper slots per counter slot
_M64 = (1 << 64) - 1
# Odd 64-bit multipliers (from well-known mixers' constants): one per counter row, then two for the doorkeeper.
_ROW_MULT = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_DOOR_MULT = (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53)


def key_hash(key: bytes) -> int:
    """The 64-bit hash the sketch counts a chunk key under (XXH3: chunk keys need not be uniform bytes)."""
    return xxhash.xxh3_64_intdigest(key)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


class FrequencySketch:
    """Counts of ``width`` slots (rounded up to a power of two) per row; halved every ``period`` sightings."""

    def __init__(self, width: int, period: int | None = None) -> None:
        width = _pow2_at_least(max(width, 64))
        self.width = width
        self._shift = 64 - (width.bit_length() - 1)
        door = width * DOOR_BITS
        self._door_shift = 64 - (door.bit_length() - 1)
        self._counts = np.zeros(ROWS * width, dtype=np.uint8)
        self._door = np.zeros(door, dtype=np.bool_)
        self._row_mult = np.array(_ROW_MULT, dtype=np.uint64)[:, None]
        self._door_mult = np.array(_DOOR_MULT, dtype=np.uint64)[:, None]
        self._row_base = (np.arange(ROWS, dtype=np.uint64) * np.uint64(width))[:, None]
        self.period = period if period is not None else 10 * width
        self.sightings = 0  # since the last halving
        self.halvings = 0

    # ---- counting ------------------------------------------------------------------------------
    def add(self, hashes: Iterable[int]) -> None:
        """One sighting of each hash: the doorkeeper takes a first one, the counters every later one."""
        h = np.fromiter(hashes, dtype=np.uint64)
        if not h.size:
            return
        door_at = (h[None, :] * self._door_mult) >> np.uint64(self._door_shift)
        known = self._door[door_at].all(axis=0)
        self._door[door_at[:, ~known]] = True
        if known.any():
            hk = h[known]
            at = ((hk[None, :] * self._row_mult) >> np.uint64(self._shift)) + self._row_base
            flat = at.ravel()
            counts = self._counts
            np.add.at(counts, flat, 1)
            over = flat[counts[flat] > CAP]
            counts[over] = CAP
        self._sighted(int(h.size))

    def mark(self, hashes: Iterable[int]) -> None:
        """A sighting that counts only as a first one: sets the doorkeeper, never a counter."""
        h = np.fromiter(hashes, dtype=np.uint64)
        if not h.size:
            return
        self._door[(h[None, :] * self._door_mult) >> np.uint64(self._door_shift)] = True
        self._sighted(int(h.size))

    def _sighted(self, n: int) -> None:
        self.sightings += n
        if self.sightings >= self.period:
            self.halve()

    def halve(self) -> None:
        """Age every count: halve the counters, clear the doorkeeper."""
        self._counts >>= 1
        self._door[:] = False
        self.sightings = 0
        self.halvings += 1

    # ---- reading -------------------------------------------------------------------------------
    def estimate(self, h: int) -> int:
        """About how many times ``h`` was seen since the last halving (the doorkeeper's bit included)."""
        door, ds = self._door, self._door_shift
        first = all(door[((h * m) & _M64) >> ds] for m in _DOOR_MULT)
        counts, s, w = self._counts, self._shift, self.width
        return int(first) + int(min(counts[r * w + (((h * m) & _M64) >> s)] for r, m in enumerate(_ROW_MULT)))
