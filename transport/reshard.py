"""Re-sharding on read: a TP=j rank's blocks assembled from the entries a TP=k world stored.

Role
    Entries stay per rank (each rank's own heads, in its own format). An engine registers, per attention
    group, how its KV heads split (``HeadSplit``: heads on each rank, heads in the model, states per page);
    with the layout tag's page order (``HNC``: a head's cells are one run of the page; ``NHC``: one run per
    state) that says where every head's bytes lie in a page. Per Mamba group it registers how each state
    splits (``MambaSplit``; transport/state_shards.py: GDN's conv and SSM states). ``refusal`` decides whether
    a world's entries can be read by another world of the same model (same TP-free model digest: the daemon's
    ``Formats.same_model``); ``block_moves`` lists, for one rank of the reader, which byte ranges of which
    source rank's block make up its block; ``segments`` turns an entry's moves into copy segments (several
    pool entries into one engine block).

Heads
    vLLM splits ``total`` KV heads over ``tp`` ranks as ``QKVParallelLinear`` does: ``total // tp`` each when
    ``tp`` divides ``total``; one each when ``total`` divides ``tp``, rank r holding head ``r // (tp // total)``
    (replicated). Any other split is refused here, naming it.

Threading
    Pure; the moves of a (source, reader, rank) triple are cheap to rebuild and are cached by the caller.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate

from hkvd.transport import state_shards
from hkvd.transport.copy_engine import Segment
from hkvd.transport.layout import GroupSpec, View, _block_template
from hkvd.transport.state_shards import MambaSplit

#: One run of a block: (offset in the reader's block, source rank, offset in that rank's block, bytes).
Move = tuple[int, int, int, int]


@dataclass(frozen=True, slots=True)
class HeadSplit:
    """How one attention group's KV heads lie on a rank: ``here`` of ``total`` heads, ``states`` per page."""

    here: int
    total: int
    states: int


@dataclass(frozen=True, slots=True)
class ShardShape:
    """What re-sharding needs of an engine world: its size, chunk, page order, groups, head and state splits."""

    world_size: int
    chunk_size: int
    order: str  # "HNC" or "NHC": the canonical page order (the layout tag's suffix)
    groups: tuple[GroupSpec, ...]
    heads: Mapping[int, HeadSplit] = field(default_factory=dict)  # attention groups only
    states: Mapping[int, MambaSplit] = field(default_factory=dict)  # Mamba groups only

    @classmethod
    def of(cls, world_size: int, chunk_size: int, layout_tag: str, groups: Sequence[GroupSpec],
           heads: Mapping[int, HeadSplit], states: Mapping[int, MambaSplit] | None = None) -> ShardShape:
        return cls(world_size, chunk_size, layout_tag.rpartition("/")[2], tuple(groups), dict(heads),
                   dict(states or {}))


def split_ok(tp: int, total: int) -> bool:
    """Whether vLLM splits ``total`` KV heads over ``tp`` ranks (evenly, or replicated)."""
    return tp >= 1 and total >= 1 and (total % tp == 0 or tp % total == 0)


def rank_heads(tp: int, total: int, rank: int) -> list[int]:
    """The model's KV heads rank ``rank`` of ``tp`` holds, in its page's order (module docstring)."""
    if not split_ok(tp, total) or not 0 <= rank < tp:
        raise ValueError(f"{total} KV heads do not split over {tp} ranks (rank {rank})")
    if total >= tp:
        per = total // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // total)]


def refusal(src: ShardShape, dst: ShardShape) -> str | None:
    """Why a world of ``dst``'s shape cannot read ``src``'s entries by re-sharding; None when it can."""
    tp_k, tp_j = src.world_size, dst.world_size
    if src.order != dst.order:
        return f"the page orders differ ({src.order} at TP={tp_k}, {dst.order} at TP={tp_j})"
    if dst.order not in ("HNC", "NHC"):
        return f"the page order {dst.order!r} is not one whose heads hkvd can find (HNC, NHC)"
    if [g.group_id for g in src.groups] != [g.group_id for g in dst.groups]:
        return "the KV-cache groups differ"
    for s, d in zip(src.groups, dst.groups, strict=True):
        where = f"group {d.group_id} ({d.kind})"
        if s.tokens_per_block != d.tokens_per_block:
            return (f"{where}: vLLM's block size differs ({s.tokens_per_block} tokens at TP={tp_k}, "
                    f"{d.tokens_per_block} at TP={tp_j})")
        if d.kind == "mamba" or s.kind == "mamba":
            if s.kind != d.kind:
                return f"{where}: kinds differ ({s.kind} at TP={tp_k})"
            if [v.num_layers for v in s.views] != [v.num_layers for v in d.views]:
                return f"{where}: the layers differ"
            why = state_shards.refusal(s, d, src.states.get(s.group_id), dst.states.get(d.group_id), tp_k, tp_j)
            if why is not None:
                return why
            continue
        if (s.kind, s.window_tokens, s.dtype) != (d.kind, d.window_tokens, d.dtype):
            return f"{where}: kind, window or dtype differ ({s.kind}/{s.window_tokens}/{s.dtype} at TP={tp_k})"
        if [v.num_layers for v in s.views] != [v.num_layers for v in d.views]:
            return f"{where}: the layers differ"
        hs, hd = src.heads.get(s.group_id), dst.heads.get(d.group_id)
        if hs is None or hd is None:
            return f"{where}: no KV-head split registered (an older shim, or a cache kind not split by head)"
        if hs.total != hd.total or hs.states != hd.states:
            return f"{where}: heads or states differ ({hs.total} heads x {hs.states} at TP={tp_k})"
        for tp, h, g in ((tp_k, hs, s), (tp_j, hd, d)):
            if not split_ok(tp, h.total) or h.here != len(rank_heads(tp, h.total, 0)):
                return f"{where}: {h.total} KV heads do not split over TP={tp} ({h.here} registered per rank)"
            if any(v.page_bytes % (h.here * h.states) for v in g.views):
                return f"{where}: a page is not {h.here} heads x {h.states} states of whole cells"
        if [v.page_bytes // hs.here for v in s.views] != [v.page_bytes // hd.here for v in d.views]:
            return f"{where}: a head's bytes differ between TP={tp_k} and TP={tp_j}"
    if src.chunk_size != dst.chunk_size:
        return f"the chunk sizes differ ({src.chunk_size} tokens at TP={tp_k}, {dst.chunk_size} at TP={tp_j})"
    return None


def _head_runs(order: str, heads: int, states: int, cell: int, h: int) -> list[tuple[int, int]]:
    """(offset in the page, bytes) of head ``h``'s cells, in the page's order."""
    if order == "HNC":
        return [(h * states * cell, states * cell)]
    return [(s * heads * cell + h * cell, cell) for s in range(states)]


def _head_page_runs(src: ShardShape, dst: ShardShape, group_id: int, rank: int,
                    dv: View) -> list[tuple[int, int, int, int]]:
    """(offset in the reader's page, source rank, offset in its page, bytes) of each head of rank ``rank``'s page,
    each head from the first source rank that holds it."""
    hs, hd = src.heads[group_id], dst.heads[group_id]
    owner: dict[int, tuple[int, int]] = {}  # model head -> (source rank, its index on that rank)
    for r in range(src.world_size):
        for i, head in enumerate(rank_heads(src.world_size, hs.total, r)):
            owner.setdefault(head, (r, i))
    cell = dv.page_bytes // (hd.here * hd.states)
    out = []
    for i, head in enumerate(rank_heads(dst.world_size, hd.total, rank)):
        r, j = owner[head]
        for (doff, n), (soff, _) in zip(_head_runs(dst.order, hd.here, hd.states, cell, i),
                                        _head_runs(src.order, hs.here, hs.states, cell, j), strict=True):
            out.append((doff, r, soff, n))
    return out


def block_moves(src: ShardShape, dst: ShardShape, group_id: int, rank: int) -> tuple[Move, ...]:
    """The runs of one block of ``group_id`` for rank ``rank`` of ``dst``, from ``src``'s ranks (``refusal``
    must have passed): an attention page's heads, each from the first source rank that holds it; a Mamba page's
    states, each part's units from the source ranks that hold them (``state_shards.page_runs``). Adjacent runs
    merge."""
    sg = next(g for g in src.groups if g.group_id == group_id)
    dg = next(g for g in dst.groups if g.group_id == group_id)
    moves: list[list[int]] = []
    s_view = d_view = 0
    for sv, dv in zip(sg.views, dg.views, strict=True):
        if dg.kind == "mamba":
            page = state_shards.page_runs(sg, dg, dst.states[group_id], src.world_size, dst.world_size, rank)
        else:
            page = _head_page_runs(src, dst, group_id, rank, dv)
        for layer in range(dv.num_layers):
            d_page, s_page = d_view + layer * dv.page_bytes, s_view + layer * sv.page_bytes
            for doff, r, soff, n in page:
                last = moves[-1] if moves else None
                if last is not None and last[1] == r and last[0] + last[3] == d_page + doff \
                        and last[2] + last[3] == s_page + soff:
                    last[3] += n
                else:
                    moves.append([d_page + doff, r, s_page + soff, n])
        s_view += sv.block_bytes
        d_view += dv.block_bytes
    return tuple((m[0], m[1], m[2], m[3]) for m in moves)


def segments(group: GroupSpec, block_ids: Sequence[int], moves: Sequence[Move], src_block_bytes: int,
             extents: Mapping[int, Sequence[tuple[int, int]]]) -> list[Segment]:
    """Copy segments that fill ``block_ids`` of the reader's ``group`` from the source ranks' entries of one
    chunk (``extents``: source rank -> its entry's pool extents), by ``moves``. Segments merge where both the
    engine and the pool side are contiguous."""
    group.validate_block_ids(block_ids)
    template, block_bytes = _block_template(group)
    t_starts = [0, *accumulate(r[3] for r in template)]
    ext_starts = {r: [0, *accumulate(n for _, n in ex)] for r, ex in extents.items()}
    for r, starts in ext_starts.items():
        if starts[-1] != len(block_ids) * src_block_bytes:
            raise ValueError(f"group {group.group_id}: source rank {r}'s entry holds {starts[-1]} bytes, "
                             f"{len(block_ids) * src_block_bytes} expected")
    out: list[list[int]] = []
    for i, b in enumerate(block_ids):
        for doff, r, soff, n in moves:
            ex, starts = extents[r], ext_starts[r]
            d, s, left = doff, i * src_block_bytes + soff, n
            while left:
                ti = bisect_right(t_starts, d) - 1
                reg, base, stride, run = template[ti]
                ei = bisect_right(starts, s) - 1
                take = min(left, t_starts[ti] + run - d, starts[ei] + ex[ei][1] - s)
                roff = base + b * stride + (d - t_starts[ti])
                poff = ex[ei][0] + (s - starts[ei])
                last = out[-1] if out else None
                if last is not None and last[0] == reg and last[1] + last[3] == roff and last[2] + last[3] == poff:
                    last[3] += take
                else:
                    out.append([reg, roff, poff, take])
                d, s, left = d + take, s + take, left - take
    del block_bytes
    return [Segment(r[0], r[1], r[2], r[3]) for r in out]
