"""Comparing an engine's recomputed blocks with the entry held under their key.

Role
    A sampled hit is recomputed by the engine instead of loaded; the service copies the engine's
    fresh blocks into a scratch pool allocation and asks ``entry_error`` how far they are from the
    entry it would have served. The answer is one number per entry, in the group's dtype
    (``GroupSpec.dtype``, from registration): the relative root-mean-square difference, the L2 norm of
    (fresh - stored) over the L2 norm of stored, taken per run of values (a Mamba page's states each on
    their own, so a small state is not drowned by a large one) and the largest of them (0.0 when every
    byte is equal; ``inf`` when a value is NaN or infinite on one side only, or the stored values are all
    zero while the fresh ones are not). ``tolerance`` says which bound applies.

Why a norm, not the largest element
    A different prefill chunking moves a few values a lot where a deep model amplifies rounding: the
    K/V of a chunk far into the prompt of an 8-layer mixture-of-experts model, recomputed, showed single
    values off by up to 0.7 of the entry's largest value while the entry as a whole was close. A wrong
    entry (another boundary's state, another prompt's chunk, a shifted byte range) differs in every
    value, and its relative norm is near 1 (about 1.4 for unrelated values of one distribution). The
    norm separates the two; the largest element does not.

Dtypes
    float16/32/64, bfloat16, float8_e4m3fn and float8_e5m2 (read through ``ml_dtypes``' NumPy types),
    uint8 (vLLM stores its fp8 caches so: decoded as e4m3fn, the format it defaults to;
    adjacent codes stay adjacent values in either fp8 format, so small differences stay small), and
    integers as integers. A Mamba group's dtype is ``state:<dtype>[shape];...``: each page holds those
    states one after another, each compared in its own dtype. A dtype outside these is compared byte
    for byte (0.0 or ``inf``): ``value_layout`` says so with ``exact``.

Threading
    Pure functions over bytes; the service runs them on a copy thread.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import numpy as np

from hkvd.transport.layout import GroupSpec

#: Bytes per value of each dtype name the comparison reads (``_numpy`` gives their NumPy types).
_ITEMSIZE = {"float16": 2, "float32": 4, "float64": 8, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2,
             "uint32": 4, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1}


@functools.cache
def _numpy() -> dict[str, type[np.generic]]:
    """Each dtype name's NumPy type. ``ml_dtypes`` (0.7 s to import) is imported at the first comparison, not
    with the daemon: most daemons never compare."""
    import ml_dtypes

    return {"float16": np.float16, "float32": np.float32, "float64": np.float64, "int8": np.int8,
            "int16": np.int16, "int32": np.int32, "int64": np.int64, "uint16": np.uint16, "uint32": np.uint32,
            "bfloat16": ml_dtypes.bfloat16, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
            "float8_e5m2": ml_dtypes.float8_e5m2,
            "uint8": ml_dtypes.float8_e4m3fn}  # vLLM's fp8 caches (module docstring)


_STATE = re.compile(r"([a-z0-9_]+)\[([0-9, ]*)\]")


def decode(raw: np.ndarray, dtype: str) -> np.ndarray:
    """``raw`` (uint8, a whole number of values) as values: float64 for floats, int64 for integers."""
    values = raw.view(_numpy()[dtype])
    return values.astype(np.int64 if values.dtype.kind in "iu" else np.float64)


@dataclass(frozen=True, slots=True)
class ValueLayout:
    """How one page of a group holds values: runs of (offset, bytes, dtype); ``exact``: bytes only."""

    runs: tuple[tuple[int, int, str], ...]
    exact: bool = False


def value_layout(group: GroupSpec) -> ValueLayout:
    """The runs of values in one page of ``group`` (every view's pages share one format)."""
    page = group.views[0].page_bytes if group.views else 0
    if any(v.page_bytes != page for v in group.views):
        return ValueLayout((), exact=True)
    if group.dtype.startswith("state:"):
        runs, off = [], 0
        for name, shape in _STATE.findall(group.dtype):
            if name not in _ITEMSIZE:
                return ValueLayout((), exact=True)
            n = _ITEMSIZE[name] * math.prod(int(d) for d in shape.split(",") if d.strip())
            runs.append((off, n, name))
            off += n
        return ValueLayout(tuple(runs)) if runs and off == page else ValueLayout((), exact=True)
    if group.dtype not in _ITEMSIZE or page % _ITEMSIZE[group.dtype]:
        return ValueLayout((), exact=True)
    return ValueLayout(((0, page, group.dtype),))


def _values(buf: np.ndarray, vl: ValueLayout, page_bytes: int) -> list[np.ndarray]:
    """Every run's values over all the entry's pages, one array per run."""
    pages = buf.reshape(-1, page_bytes)
    return [decode(np.ascontiguousarray(pages[:, off:off + n]).reshape(-1), dtype) for off, n, dtype in vl.runs]


def entry_error(fresh: memoryview | bytes, stored: memoryview | bytes, group: GroupSpec) -> float:
    """||fresh - stored|| / ||stored|| over one entry of ``group``, per run of values, the largest (module
    docstring)."""
    a = np.frombuffer(fresh, np.uint8)
    b = np.frombuffer(stored, np.uint8)
    if a.shape != b.shape:
        raise ValueError(f"an entry of group {group.group_id} is {b.size} bytes, its recomputed copy {a.size}")
    if np.array_equal(a, b):
        return 0.0
    vl = value_layout(group)
    page = group.views[0].page_bytes
    if vl.exact or a.size % page:
        return math.inf
    worst = 0.0
    for x, y in zip(_values(a, vl, page), _values(b, vl, page), strict=True):
        if x.dtype.kind == "f":
            same = (x == y) | (np.isnan(x) & np.isnan(y))
            if not np.isfinite(x[~same]).all() or not np.isfinite(y[~same]).all():
                return math.inf
            diff = np.where(same, 0.0, x - y)
            y = np.where(np.isfinite(y), y, 0.0)
        else:
            diff = (x - y).astype(np.float64)
        num = float(np.sqrt(np.sum(np.square(diff, dtype=np.float64))))
        if num == 0.0:
            continue
        den = float(np.sqrt(np.sum(np.square(y.astype(np.float64)))))
        if den == 0.0:
            return math.inf
        worst = max(worst, num / den)
    return worst


def tolerance(kind: str, attention: float, mamba: float) -> float:
    """The bound for a group kind: ``mamba`` for recurrent states, ``attention`` for K/V (full, swa)."""
    return mamba if kind == "mamba" else attention
