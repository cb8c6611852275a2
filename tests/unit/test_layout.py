"""Layout arithmetic: segments_for_entry(ies) against a byte-by-byte reference on random views."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvd.transport.copy_engine import Segment
from hkvd.transport.layout import (
    MAX_PIECES,
    GroupSpec,
    View,
    blocks_per_entry,
    entry_bytes,
    segments_for_entries,
    segments_for_entry,
)

# -- reference ---------------------------------------------------------------------------------


def reference_bytes(group: GroupSpec, block_ids: list[int]) -> list[tuple[int, int]]:
    """(region, region byte) of every logical byte of the entry, straight from the design doc."""
    out: list[tuple[int, int]] = []
    for b in block_ids:
        for v in group.views:
            for layer in range(v.num_layers):
                start = v.offset + layer * v.layer_stride + b * v.block_stride
                for off, n in v.pieces or ((0, v.page_bytes),):  # a scattered page: its pieces in order
                    out.extend((v.region_id, start + off + i) for i in range(n))
    return out


def pool_bytes(extents: list[tuple[int, int]]) -> list[int]:
    return [off + i for off, n in extents for i in range(n)]


def expand(segments: list[Segment]) -> tuple[list[tuple[int, int]], list[int]]:
    engine: list[tuple[int, int]] = []
    pool: list[int] = []
    for s in segments:
        engine.extend((s.region_id, s.region_offset + i) for i in range(s.nbytes))
        pool.extend(s.pool_offset + i for i in range(s.nbytes))
    return engine, pool


def region_end(v: View, num_blocks: int) -> int:
    return v.offset + (v.num_layers - 1) * v.layer_stride + (num_blocks - 1) * v.block_stride + v.page_bytes


# -- strategies --------------------------------------------------------------------------------


@st.composite
def views(draw: st.DrawFn, num_blocks: int, region_id: int) -> View:
    layers = draw(st.integers(1, 4))
    page = draw(st.integers(1, 48))
    pad = draw(st.sampled_from([0, 0, draw(st.integers(1, 24))]))  # packed twice as often as strided
    offset = draw(st.integers(0, 64))
    style = draw(st.sampled_from(["BL", "LB", "mamba"]))
    if style == "BL":  # [block][layer][page]: consecutive layers are adjacent
        layer_stride = page + pad
        block_stride = layers * layer_stride + draw(st.sampled_from([0, 8]))
    elif style == "LB":  # [layer][block][page]: consecutive blocks are adjacent
        block_stride = page + pad
        layer_stride = num_blocks * block_stride + draw(st.sampled_from([0, 8]))
    else:  # mamba: a padded page inside a larger per-block slot, one tensor per layer
        block_stride = page + draw(st.integers(1, 32))
        layer_stride = num_blocks * block_stride
    # Pieces: the page cut into up to 4 runs, listed in a random order (heads outside the block dim).
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, page - 1)), max_size=3))) - {page})
    runs = [(lo, hi - lo) for lo, hi in itertools.pairwise([0, *cuts, page])]
    pieces = tuple(draw(st.permutations(runs))) if draw(st.booleans()) else ()
    return View(region_id, offset, layers, layer_stride, block_stride, page, pieces)


@st.composite
def cases(draw: st.DrawFn) -> tuple[GroupSpec, dict[int, int], list[int], list[tuple[int, int]]]:
    kind = draw(st.sampled_from(["full", "swa", "mamba"]))
    num_blocks = draw(st.integers(2, 7))
    n_views = draw(st.integers(1, 3))
    shared_region = draw(st.booleans())  # views in one region (K and V of one tensor) or one each
    vs = tuple(draw(views(num_blocks, 0 if shared_region else i)) for i in range(n_views))
    if shared_region and n_views > 1:
        # Place later views after earlier ones so views do not overlap inside the shared region.
        placed: list[View] = []
        end = 0
        for v in vs:
            placed.append(replace(v, offset=end + v.offset))
            end = region_end(placed[-1], num_blocks)
        vs = tuple(placed)
    group = GroupSpec(1, kind, 16, 64 if kind == "swa" else 0, num_blocks, "bfloat16", vs)
    regions: dict[int, int] = {}
    for v in vs:
        regions[v.region_id] = max(regions.get(v.region_id, 0), region_end(v, num_blocks))
    n_ids = 1 if kind == "mamba" else draw(st.integers(1, 4))
    block_ids = draw(st.lists(st.integers(1, num_blocks - 1), min_size=n_ids, max_size=n_ids))
    total = len(block_ids) * group.block_bytes
    # Random extents: cut points inside the entry, each piece placed after a random gap
    # (gap 0 makes neighbouring extents contiguous, which must merge like one extent).
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, total - 1)), max_size=4))) - {total})
    bounds = [0, *cuts, total]
    extents, pos = [], draw(st.integers(0, 100))
    for lo, hi in itertools.pairwise(bounds):
        extents.append((pos, hi - lo))
        pos += hi - lo + draw(st.sampled_from([0, 4096, draw(st.integers(1, 50))]))
    return group, regions, block_ids, extents


# -- properties --------------------------------------------------------------------------------


@settings(max_examples=400, deadline=None)
@given(cases())
def test_segments_match_reference(
    case: tuple[GroupSpec, dict[int, int], list[int], list[tuple[int, int]]],
) -> None:
    group, regions, block_ids, extents = case
    group.validate(regions)
    segs = segments_for_entry(group, block_ids, extents)
    engine, pool = expand(segs)
    assert engine == reference_bytes(group, block_ids)
    assert pool == pool_bytes(extents)
    for s in segs:
        assert s.nbytes > 0
        assert s.region_offset + s.nbytes <= regions[s.region_id]
    # Maximally merged: no two neighbours could have been one segment.
    for a, b in itertools.pairwise(segs):
        assert not (
            a.region_id == b.region_id
            and a.region_offset + a.nbytes == b.region_offset
            and a.pool_offset + a.nbytes == b.pool_offset
        )


@st.composite
def batches(draw: st.DrawFn) -> list[tuple[GroupSpec, dict[int, int], list[int], list[tuple[int, int]]]]:
    """Entries for one call: a few random cases, each followed by entries of its own group whose
    blocks and pool slots are often adjacent to the previous entry's (or just not)."""
    out = []
    for group, regions, block_ids, extents in draw(st.lists(cases(), min_size=1, max_size=3)):
        out.append((group, regions, block_ids, extents))
        pos = extents[-1][0] + extents[-1][1]
        last = block_ids[-1]
        for _ in range(draw(st.integers(0, 3))):
            n = 1 if group.kind == "mamba" else len(block_ids)
            nxt = last + 1 if draw(st.booleans()) and last + n < group.num_blocks else None
            ids = list(range(nxt, nxt + n)) if nxt else draw(
                st.lists(st.integers(1, group.num_blocks - 1), min_size=n, max_size=n))
            pos += draw(st.sampled_from([0, 0, 64, draw(st.integers(1, 50))]))  # adjacent pool slots, or a gap
            out.append((group, regions, ids, [(pos, n * group.block_bytes)]))
            pos += n * group.block_bytes
            last = ids[-1]
    return out


@settings(max_examples=400, deadline=None)
@given(batches(), st.booleans())
def test_segments_for_entries_match_reference(
    batch: list[tuple[GroupSpec, dict[int, int], list[int], list[tuple[int, int]]]], packed: bool,
) -> None:
    """A batch maps exactly the bytes of each entry in order, merged at most (across entries too)."""
    if packed:  # every entry in one extent, back to back in the pool
        pos, repacked = 0, []
        for group, regions, block_ids, _ in batch:
            n = len(block_ids) * group.block_bytes
            repacked.append((group, regions, block_ids, [(pos, n)]))
            pos += n
        batch = repacked
    segs = segments_for_entries([(g, b, e) for g, _, b, e in batch])
    engine, pool = expand(segs)
    assert engine == [x for g, _, b, _ in batch for x in reference_bytes(g, b)]
    assert pool == [x for _, _, _, e in batch for x in pool_bytes(e)]
    for a, b in itertools.pairwise(segs):
        assert not (
            a.region_id == b.region_id
            and a.region_offset + a.nbytes == b.region_offset
            and a.pool_offset + a.nbytes == b.pool_offset
        )


def test_segments_for_entries_merges_consecutive_entries_and_checks_each() -> None:
    g = bl_group(num_blocks=8)
    n = g.block_bytes
    # Blocks 2, 3, 4 in consecutive pool slots: one segment; block 6 breaks the engine side.
    segs = segments_for_entries([(g, [2], [(0, n)]), (g, [3], [(n, n)]), (g, [4], [(2 * n, n)]),
                                 (g, [6], [(3 * n, n)])])
    assert segs == [Segment(0, 2 * n, 0, 3 * n), Segment(0, 6 * n, 3 * n, n)]
    with pytest.raises(ValueError, match="null block"):
        segments_for_entries([(g, [2], [(0, n)]), (g, [0], [(n, n)])])
    with pytest.raises(ValueError, match="outside"):
        segments_for_entries([(g, [8], [(0, n)])])
    with pytest.raises(ValueError, match="extents hold"):
        segments_for_entries([(g, [2], [(0, n)]), (g, [3], [(n, n - 1)])])
    with pytest.raises(ValueError, match="at least one"):
        segments_for_entries([(g, [], [])])
    with pytest.raises(ValueError, match="exactly one"):
        segments_for_entries([(replace(g, kind="mamba"), [1, 2], [(0, 2 * n)])])


@settings(max_examples=200, deadline=None)
@given(cases())
def test_validate_bound_is_tight(
    case: tuple[GroupSpec, dict[int, int], list[int], list[tuple[int, int]]],
) -> None:
    group, regions, _, _ = case
    group.validate(regions)
    for rid in regions:
        smaller = {**regions, rid: regions[rid] - 1}
        with pytest.raises(ValueError, match=f"region {rid}"):
            group.validate(smaller)


# -- examples ----------------------------------------------------------------------------------


def bl_group(num_blocks: int = 8, layers: int = 4, page: int = 64) -> GroupSpec:
    v = View(0, 0, layers, page, layers * page, page)
    return GroupSpec(0, "full", 16, 0, num_blocks, "float16", (v,))


def test_block_major_consecutive_blocks_collapse_to_one_segment() -> None:
    g = bl_group()
    segs = segments_for_entry(g, [3, 4, 5], [(4096, 3 * g.block_bytes)])
    assert segs == [Segment(0, 3 * g.block_bytes, 4096, 3 * g.block_bytes)]


def test_page_straddling_two_extents_is_split() -> None:
    g = bl_group(layers=1, page=100)
    segs = segments_for_entry(g, [1, 3], [(0, 150), (1000, 50)])
    assert segs == [Segment(0, 100, 0, 150 - 50), Segment(0, 300, 100, 50), Segment(0, 350, 1000, 50)]


def test_entry_sizes() -> None:
    k = View(0, 0, 2, 0x1000, 0x2000, 512)
    full = GroupSpec(0, "full", 16, 0, 10, "bfloat16", (k, replace(k, page_bytes=256)))
    assert blocks_per_entry(full, 256) == 16
    assert entry_bytes(full, 256) == 16 * (2 * 512 + 2 * 256)
    mamba = replace(full, kind="mamba", tokens_per_block=1024)
    assert blocks_per_entry(mamba, 256) == 1
    assert entry_bytes(mamba, 256) == 2 * 512 + 2 * 256
    with pytest.raises(ValueError, match="multiple"):
        blocks_per_entry(full, 100)
    with pytest.raises(ValueError):
        blocks_per_entry(full, 0)


def test_rejects_null_and_out_of_range_blocks() -> None:
    g = bl_group(num_blocks=8)
    ext = [(0, g.block_bytes)]
    with pytest.raises(ValueError, match="null block"):
        segments_for_entry(g, [0], ext)
    with pytest.raises(ValueError, match="outside"):
        segments_for_entry(g, [8], ext)
    with pytest.raises(ValueError, match="outside"):
        segments_for_entry(g, [-1], ext)
    with pytest.raises(ValueError, match="at least one"):
        segments_for_entry(g, [], [])


def test_rejects_wrong_extent_total_and_multi_block_mamba() -> None:
    g = bl_group()
    with pytest.raises(ValueError, match="extents hold"):
        segments_for_entry(g, [1], [(0, g.block_bytes - 1)])
    with pytest.raises(ValueError, match="extents hold"):
        segments_for_entry(g, [1], [(0, g.block_bytes), (9999, 1)])
    with pytest.raises(ValueError, match="exactly one"):
        segments_for_entry(replace(g, kind="mamba"), [1, 2], [(0, 2 * g.block_bytes)])


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"kind": "linear"}, "kind"),
        ({"tokens_per_block": 0}, "tokens_per_block"),
        ({"num_blocks": 1}, "num_blocks"),
        ({"views": ()}, "no views"),
        ({"kind": "swa", "window_tokens": 0}, "window_tokens"),
        ({"views": (View(0, 0, 4, 64, 256, 0),)}, "page_bytes"),
        ({"views": (View(0, 0, 0, 64, 256, 64),)}, "num_layers"),
        ({"views": (View(0, 0, 4, 64, 0, 64),)}, "block_stride"),
        ({"views": (View(0, 0, 4, 0, 256, 64),)}, "layer_stride"),
        ({"views": (View(0, -1, 4, 64, 256, 64),)}, "offset"),
        ({"views": (View(7, 0, 4, 64, 256, 64),)}, "region 7 is not registered"),
    ],
)
def test_validate_rejects(change: dict[str, object], match: str) -> None:
    g = replace(bl_group(), **change)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        g.validate({0: 1 << 20})


def test_validate_without_regions_checks_format_only() -> None:
    g = bl_group()
    g.validate(None)
    with pytest.raises(ValueError, match="kind"):
        replace(g, kind="linear").validate(None)


# -- pieces: a page whose bytes are scattered, taken in the order its view lists them --------------


def test_pieces_are_copied_in_their_order_not_address_order() -> None:
    """A 96-byte page stored as three runs, listed last-first: an entry holds them in the listed order, so the
    pool bytes are a permutation of the engine bytes that matches the listing, block after block."""
    pieces = ((64, 32), (0, 32), (32, 32))
    v = View(0, 100, 1, 0, 128, 96, pieces)
    g = GroupSpec(0, "full", 16, 0, 8, "int8", (v,))
    g.validate({0: 100 + 7 * 128 + 96})
    segs = segments_for_entry(g, [2, 5], [(1000, 2 * 96)])
    want = []
    for i, b in enumerate((2, 5)):
        page = 100 + b * 128
        pool = 1000 + i * 96
        want += [Segment(0, page + 64, pool, 32), Segment(0, page, pool + 32, 64)]  # the last two merge
    assert segs == want
    assert segments_for_entries([(g, [2, 5], [(1000, 2 * 96)])]) == want
    # A whole page listed as one piece is the same as no pieces.
    one = replace(g, views=(replace(v, pieces=((0, 96),)),))
    assert segments_for_entry(one, [2], [(0, 96)]) == segments_for_entry(replace(g, views=(replace(v, pieces=()),)),
                                                                          [2], [(0, 96)])


def test_pieces_straddle_extents_and_follow_layers() -> None:
    v = View(3, 0, 2, 1000, 100, 40, ((20, 20), (0, 20)))  # two layers, each page's halves swapped
    g = GroupSpec(0, "full", 16, 0, 4, "int8", (v,))
    segs = segments_for_entry(g, [1], [(0, 30), (500, 50)])
    assert [(s.region_offset, s.pool_offset, s.nbytes) for s in segs] == [
        (120, 0, 20), (100, 20, 10), (110, 500, 10), (1120, 510, 20), (1100, 530, 20)]


@pytest.mark.parametrize(("pieces", "match"), [
    (((0, 32), (32, 0)), "bytes > 0"),
    (((-1, 32), (31, 32)), "offset >= 0"),
    (((0, 32), (32, 31)), "pieces hold 63 bytes"),
    (((0, 33), (32, 31)), "overlap"),
    (((40, 32), (0, 32)), None),  # a gap is fine: only the page's own bytes are copied
    (((40, 32), (0, 32)), "past the end"),  # ... but the last piece must stay inside the region
])
def test_validate_checks_pieces(pieces: tuple[tuple[int, int], ...], match: str | None) -> None:
    v = View(0, 0, 2, 1024, 128, 64, pieces)
    g = GroupSpec(0, "full", 16, 0, 4, "int8", (v,))
    last = 1024 + 3 * 128
    if match is None:
        g.validate({0: last + 72})
        return
    size = last + 71 if match == "past the end" else 1 << 20
    with pytest.raises(ValueError, match=match):
        g.validate({0: size})
    if match != "past the end":  # a format error even without regions
        with pytest.raises(ValueError, match=match):
            g.validate(None)


def test_validate_bounds_the_number_of_pieces() -> None:
    many = tuple((2 * i, 1) for i in range(MAX_PIECES + 1))
    g = GroupSpec(0, "full", 16, 0, 4, "int8", (View(0, 0, 1, 0, 1 << 14, MAX_PIECES + 1, many),))
    with pytest.raises(ValueError, match=f"at most {MAX_PIECES}"):
        g.validate(None)
    replace(g, views=(View(0, 0, 1, 0, 1 << 14, MAX_PIECES, many[:-1]),)).validate(None)
