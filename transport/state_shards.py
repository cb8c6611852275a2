"""Re-sharding Mamba/GDN states on read: where a TP=j rank's states lie in the pages of a TP=k world's ranks.

Role
    A Mamba group's page holds the layer's states one after another, in the order vLLM declares them
    (``MambaSpec.shapes``: vLLM's ``MambaBase.bind_kv_cache`` cuts each per-layer page so), each a C-order array
    of its per-rank shape and dtype; the group's dtype string names them (``state:bfloat16[3, 1024];float32[4,
    128, 128]``, ``parse_states``). An engine registers, per Mamba group, vLLM's Mamba type and how each state
    splits over TP ranks (``StateSplit``): along one axis of its shape, the concatenation of parts, each part of
    T units split evenly (rank r of tp holds units ``[r*T/tp, (r+1)*T/tp)`` of it). For GDN (Qwen3-Next):
    the conv state ``(state_len, conv_dim)`` (vLLM's "SD" layout; "DS" is ``(conv_dim, state_len)``) along
    conv_dim, parts (key_dim, key_dim, value_dim) (its q, k and v channels); the SSM state ``(num_v_heads,
    head_v_dim, head_k_dim)`` along the value heads, one part.
    ``refusal`` says whether two worlds' pages of one group agree with their splits; ``page_runs`` lists a reader
    rank's page as byte runs of the source ranks' pages.

Threading
    Pure.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from hkvd.transport.layout import GroupSpec

#: Bytes per value of the dtype names a state may have.
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "int8": 1, "uint8": 1, "int16": 2,
            "uint16": 2, "int32": 4, "uint32": 4, "int64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}

_STATE = re.compile(r"([a-z0-9_]+)\[([0-9, ]*)\]")

#: One run of a page: (offset in the reader's page, source rank, offset in that rank's page, bytes).
Run = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class StateSplit:
    """How one state of a page splits over TP ranks: along ``axis`` of its shape, parts of ``totals`` units."""

    axis: int
    totals: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class MambaSplit:
    """One Mamba group's registration: vLLM's Mamba type (``gdn_attn``, ``mamba2``, ...) and a split per state;
    no splits: a type whose states the engine does not describe (not re-sharded)."""

    mamba_type: str
    states: tuple[StateSplit, ...]


def parse_states(dtype: str) -> list[tuple[str, tuple[int, ...]]] | None:
    """The (dtype, shape) of each state of a Mamba group's dtype string; None when it names none or a dtype
    whose size is not known here."""
    if not dtype.startswith("state:"):
        return None
    out = []
    for part in dtype.removeprefix("state:").split(";"):
        m = _STATE.fullmatch(part.strip())
        if m is None or m.group(1) not in ITEMSIZE:
            return None
        out.append((m.group(1), tuple(int(d) for d in m.group(2).split(",") if d.strip())))
    return out


def _page_bytes(states: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(ITEMSIZE[dt] * math.prod(shape) for dt, shape in states)


def refusal(src: GroupSpec, dst: GroupSpec, ms: MambaSplit | None, md: MambaSplit | None, tp_k: int,
            tp_j: int) -> str | None:
    """Why ``dst``'s pages (TP=``tp_j``) cannot be assembled from ``src``'s (TP=``tp_k``); None when they can."""
    where = f"group {dst.group_id} (mamba)"
    if ms is None or md is None:
        return (f"{where}: its Mamba states are not re-sharded across TP sizes: no state split registered "
                f"at TP={tp_k if ms is None else tp_j} (an older shim)")
    for m in (ms, md):
        if not m.states:
            return (f"{where}: its Mamba states are not re-sharded across TP sizes: {m.mamba_type} states "
                    "(the shim describes how GDN states split, no other Mamba type's)")
    if ms != md:
        return (f"{where}: the state splits differ ({ms.mamba_type} {_show(ms)} at TP={tp_k}, {md.mamba_type} "
                f"{_show(md)} at TP={tp_j})")
    ps, pd = parse_states(src.dtype), parse_states(dst.dtype)
    if ps is None or pd is None:
        return f"{where}: its dtype {(src.dtype if ps is None else dst.dtype)!r} names no states hkvd can read"
    if not len(ps) == len(pd) == len(ms.states):
        return f"{where}: {len(ms.states)} state splits for {len(ps)} states at TP={tp_k}, {len(pd)} at TP={tp_j}"
    for i, ((dts, shs), (dtd, shd), sp) in enumerate(zip(ps, pd, ms.states, strict=True)):
        if dts != dtd:
            return f"{where}: state {i}'s dtype differs ({dts} at TP={tp_k}, {dtd} at TP={tp_j})"
        ax = sp.axis
        if not (0 <= ax < len(shs) and len(shs) == len(shd)) or shs[:ax] + shs[ax + 1:] != shd[:ax] + shd[ax + 1:]:
            return (f"{where}: state {i}'s shape differs beyond its split axis {ax} ({list(shs)} at TP={tp_k}, "
                    f"{list(shd)} at TP={tp_j})")
        for tp, sh in ((tp_k, shs), (tp_j, shd)):
            if any(t % tp for t in sp.totals):
                return f"{where}: state {i}'s parts {list(sp.totals)} do not split over TP={tp}"
            if sh[ax] != sum(t // tp for t in sp.totals):
                return (f"{where}: state {i} is {list(sh)} at TP={tp}, not its parts {list(sp.totals)} over {tp} "
                        f"ranks along axis {ax}")
    for g, p in ((src, ps), (dst, pd)):
        if any(v.page_bytes != _page_bytes(p) for v in g.views):
            return f"{where}: a page is not its states' {_page_bytes(p)} bytes ({g.dtype})"
    return None


def _show(m: MambaSplit) -> str:
    return str([[s.axis, list(s.totals)] for s in m.states])


def page_runs(src: GroupSpec, dst: GroupSpec, split: MambaSplit, tp_k: int, tp_j: int, rank: int) -> list[Run]:
    """The runs of rank ``rank``'s page (TP=``tp_j``) in the pages of the source ranks (TP=``tp_k``), in the
    reader's page order (``refusal`` must have passed): per state, per index of the dims before its split axis,
    per part, the reader's units of the part from the source ranks that hold them."""
    ps, pd = parse_states(src.dtype), parse_states(dst.dtype)
    assert ps is not None and pd is not None
    out: list[Run] = []
    s_off = d_off = 0
    for (dt, shs), (_, shd), sp in zip(ps, pd, split.states, strict=True):
        ax = sp.axis
        unit = ITEMSIZE[dt] * math.prod(shd[ax + 1:])  # bytes of one unit along the axis (equal on both sides)
        for o in range(math.prod(shd[:ax])):
            base_k = o * shs[ax]  # units before this row's first part, in a source page and in the reader's
            base_j = o * shd[ax]
            for total in sp.totals:
                per_k, per_j = total // tp_k, total // tp_j
                a, end = rank * per_j, (rank + 1) * per_j  # the reader's units of this part, in the model's
                while a < end:
                    r = a // per_k
                    b = min(end, (r + 1) * per_k)
                    out.append((d_off + (base_j + a - rank * per_j) * unit, r,
                                s_off + (base_k + a - r * per_k) * unit, (b - a) * unit))
                    a = b
                base_k += per_k
                base_j += per_j
        s_off += ITEMSIZE[dt] * math.prod(shs)
        d_off += ITEMSIZE[dt] * math.prod(shd)
    return out
