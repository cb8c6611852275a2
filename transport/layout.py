"""Stride arithmetic: where an entry's bytes live in an engine and in the pool.

Role
    Pure functions shared by the host (``hkvd.daemon.engines.host_engine``) and CUDA (``hkvd.cuda.copy``) copy
    engines and by registration. ``View`` and ``GroupSpec`` are the registered description of
    one KV-cache group (see docs/design.md, "Registration"); the wire code imports them from
    here. Nothing here touches memory.

Layout of an entry (the contract with every engine and every peer)
    An entry is one group's bytes for one chunk: for each block id in order, for each view in
    order, for each layer in order, the ``page_bytes`` of the page that starts at
    ``view.offset + layer * view.layer_stride + block * view.block_stride`` of ``view.region_id``.
    A page's bytes are taken in its canonical order: the view's ``pieces`` ((offset from the page
    start, bytes) each, in that order), or the one contiguous run when it has none. Those logical
    bytes are laid into the pool extents in order; a piece may straddle two extents and is then
    split. Strides and pieces are not part of the format: two engines whose views have the same
    (num_layers, page_bytes) share entries whatever their strides and pieces, so an engine whose
    page is scattered (heads outside the block dim, kernel blocks) lists the pieces that put its
    bytes in the canonical order its registration names (``hkvd.shim.kv_views``).

Threading
    Pure and immutable, apart from a bounded cache of per-group block templates (plain dict
    operations, atomic under the GIL); safe from any thread.

Contracts
    - ``GroupSpec.validate`` raises ``ValueError`` naming the group and view when a view leaves
      its region for some block in [0, num_blocks) and layer, when its pieces are not positive,
      disjoint and ``page_bytes`` in all, or when a field is nonsensical.
    - ``segments_for_entry`` rejects block id 0 (vLLM's null block: never copied) and ids outside
      [1, num_blocks), and extents that do not cover exactly the entry's bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

from hkvd.transport.copy_engine import Segment

KINDS = ("full", "swa", "mamba")
NULL_BLOCK = 0
MAX_PIECES = 4096  # per view: beyond this a page is too scattered to copy one run at a time
Pieces = tuple[tuple[int, int], ...]  # (byte offset from the page start, bytes), in canonical order


@dataclass(frozen=True, slots=True)
class View:
    """One tensor of a group: layer l, block b is at ``offset + l*layer_stride + b*block_stride``.

    ``block_stride == page_bytes * num_layers`` with ``layer_stride == page_bytes`` is the
    block-major (BL) layout; ``layer_stride == num_blocks * block_stride`` is layer-major (LB).
    Mamba views usually have ``page_bytes`` smaller than ``block_stride`` (padded pages).
    ``pieces``: where the page's bytes live, in the entry's order, as (offset from the page start,
    bytes) runs summing to ``page_bytes``; empty (the default) is the one contiguous page.
    """

    region_id: int
    offset: int
    num_layers: int
    layer_stride: int
    block_stride: int
    page_bytes: int
    pieces: Pieces = ()

    @property
    def block_bytes(self) -> int:
        """Bytes this view contributes to one block of an entry."""
        return self.num_layers * self.page_bytes

    @property
    def runs(self) -> Pieces:
        """The page's runs in entry order: ``pieces``, or the whole page."""
        return self.pieces or ((0, self.page_bytes),)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    group_id: int
    kind: str
    tokens_per_block: int
    window_tokens: int
    num_blocks: int
    dtype: str
    views: tuple[View, ...]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every view and layer."""
        return sum(v.block_bytes for v in self.views)

    def validate(self, regions: Mapping[int, int] | None) -> None:
        """Check the group against its registered regions (region id -> size in bytes).

        ``regions=None`` checks the format only (a scheduler-side registration has no regions).
        """
        where = f"group {self.group_id}"
        if self.kind not in KINDS:
            raise ValueError(f"{where}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.tokens_per_block <= 0:
            raise ValueError(f"{where}: tokens_per_block must be positive, got {self.tokens_per_block}")
        if self.window_tokens < 0:
            raise ValueError(f"{where}: window_tokens must be >= 0, got {self.window_tokens}")
        if self.kind == "swa" and self.window_tokens == 0:
            raise ValueError(f"{where}: an swa group needs window_tokens > 0")
        if self.num_blocks < 2:
            # Block 0 is vLLM's null block, so fewer than 2 blocks leaves nothing to copy.
            raise ValueError(
                f"{where}: num_blocks must be >= 2 (block 0 is the null block), got {self.num_blocks}"
            )
        if not self.views:
            raise ValueError(f"{where}: no views")
        for i, v in enumerate(self.views):
            _validate_view(f"{where} view {i}", v, self.num_blocks, regions)

    def validate_block_ids(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if b == NULL_BLOCK:
                raise ValueError(f"group {self.group_id}: block id 0 is vLLM's null block, never copied")
            if not 0 < b < self.num_blocks:
                raise ValueError(f"group {self.group_id}: block id {b} outside [1, {self.num_blocks})")


def _validate_view(where: str, v: View, num_blocks: int, regions: Mapping[int, int] | None) -> None:
    if v.page_bytes <= 0:
        raise ValueError(f"{where}: page_bytes must be positive, got {v.page_bytes}")
    if v.num_layers <= 0:
        raise ValueError(f"{where}: num_layers must be positive, got {v.num_layers}")
    if v.offset < 0 or v.layer_stride < 0 or v.block_stride < 0:
        raise ValueError(
            f"{where}: offset and strides must be >= 0, got offset={v.offset} "
            f"layer_stride={v.layer_stride} block_stride={v.block_stride}"
        )
    # Zero strides would alias distinct (layer, block) pages: a retrieve would overwrite one
    # block with another's bytes. (A full non-overlap proof is a lattice problem; these are the
    # cases a wrong stride computation actually produces.)
    if v.num_layers > 1 and v.layer_stride == 0:
        raise ValueError(f"{where}: layer_stride is 0 with {v.num_layers} layers (layers would alias)")
    if v.block_stride == 0:
        raise ValueError(f"{where}: block_stride is 0 (blocks would alias)")
    page_end = _validate_pieces(where, v)
    if regions is None:
        return
    if v.region_id not in regions:
        raise ValueError(f"{where}: region {v.region_id} is not registered (have {sorted(regions)})")
    size = regions[v.region_id]
    # Strides are >= 0, so the last byte touched is at the last layer of the last block.
    end = v.offset + (v.num_layers - 1) * v.layer_stride + (num_blocks - 1) * v.block_stride + page_end
    if end > size:
        raise ValueError(
            f"{where}: layer {v.num_layers - 1} of block {num_blocks - 1} ends at byte {end}, past the end "
            f"of region {v.region_id} ({size} bytes)"
        )


def _validate_pieces(where: str, v: View) -> int:
    """Check ``v.pieces``; return the end of the page's last byte from the page start."""
    if not v.pieces:
        return v.page_bytes
    if len(v.pieces) > MAX_PIECES:
        raise ValueError(f"{where}: {len(v.pieces)} pieces, at most {MAX_PIECES}")
    total = 0
    for off, n in v.pieces:
        if off < 0 or n <= 0:
            raise ValueError(f"{where}: piece ({off}, {n}) needs offset >= 0 and bytes > 0")
        total += n
    if total != v.page_bytes:
        raise ValueError(f"{where}: pieces hold {total} bytes, page_bytes is {v.page_bytes}")
    ordered = sorted(v.pieces)
    for (a, n), (b, _) in pairwise(ordered):
        if a + n > b:
            raise ValueError(f"{where}: pieces at offsets {a} ({n} bytes) and {b} overlap")
    return ordered[-1][0] + ordered[-1][1]


def blocks_per_entry(group: GroupSpec, chunk_size: int) -> int:
    """Blocks in one entry: chunk_size / tokens_per_block for full and swa, 1 for mamba."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if group.kind == "mamba":
        return 1  # the state after exactly the chunk's last token
    if chunk_size % group.tokens_per_block:
        raise ValueError(
            f"group {group.group_id}: chunk_size {chunk_size} is not a multiple of its "
            f"tokens_per_block {group.tokens_per_block}"
        )
    return chunk_size // group.tokens_per_block


def entry_bytes(group: GroupSpec, chunk_size: int) -> int:
    return blocks_per_entry(group, chunk_size) * group.block_bytes


# Per-group block templates, keyed by id(group) and holding the group itself (so the id stays
# valid); bounded: registrations are few, and a full cache is simply emptied.
_TEMPLATES: dict[int, tuple[GroupSpec, tuple[tuple[int, int, int, int], ...], int]] = {}
_TEMPLATES_MAX = 1024


def _block_template(group: GroupSpec) -> tuple[tuple[tuple[int, int, int, int], ...], int]:
    """The pages of one block as runs ``(region_id, offset at block 0, block_stride, nbytes)``.

    Each page contributes its pieces in order. Consecutive runs merge into one when they are
    adjacent in the same region for *every* block, i.e. with equal block strides (block-major
    layouts: all layers of a view become one run). Returns the runs and the block's bytes.
    """
    hit = _TEMPLATES.get(id(group))
    if hit is not None and hit[0] is group:
        return hit[1], hit[2]
    runs: list[list[int]] = []
    for v in group.views:
        for layer in range(v.num_layers):
            page = v.offset + layer * v.layer_stride
            for piece, nbytes in v.runs:
                off = page + piece
                last = runs[-1] if runs else None
                if (last is not None and last[0] == v.region_id and last[2] == v.block_stride
                        and last[1] + last[3] == off):
                    last[3] += nbytes
                else:
                    runs.append([v.region_id, off, v.block_stride, nbytes])
    template = tuple((r[0], r[1], r[2], r[3]) for r in runs)
    block = sum(r[3] for r in template)
    if len(_TEMPLATES) >= _TEMPLATES_MAX:
        _TEMPLATES.clear()
    _TEMPLATES[id(group)] = (group, template, block)
    return template, block


def _checked_template(
    group: GroupSpec, block_ids: Sequence[int], extents: Sequence[tuple[int, int]]
) -> tuple[tuple[tuple[int, int, int, int], ...], int]:
    """The group's block template, once the entry's block ids and pool extents are checked."""
    if not block_ids:
        raise ValueError(f"group {group.group_id}: an entry needs at least one block id")
    if group.kind == "mamba" and len(block_ids) != 1:
        raise ValueError(
            f"group {group.group_id}: a mamba entry names exactly one block, got {len(block_ids)}"
        )
    num_blocks = group.num_blocks
    for b in block_ids:
        if not 0 < b < num_blocks:
            group.validate_block_ids(block_ids)  # raises with the precise message
    template, block_bytes = _block_template(group)
    need = len(block_ids) * block_bytes
    have = 0
    for off, length in extents:
        if off < 0 or length <= 0:
            raise ValueError(f"bad pool extent ({off}, {length})")
        have += length
    if have != need:
        raise ValueError(f"group {group.group_id}: extents hold {have} bytes, the entry has {need}")
    return template, block_bytes


def segments_for_entries(
    entries: Iterable[tuple[GroupSpec, Sequence[int], Sequence[tuple[int, int]]]],
) -> list[Segment]:
    """``segments_for_entry`` for each ``(group, block_ids, extents)`` in order, as one list.

    Pieces merge across entries too, where both sides are contiguous: entries in consecutive
    pool slots read from consecutive engine blocks become one segment (one iovec, one copy row).
    """
    out: list[Segment] = []
    is_open = False  # the open segment: engine region ``reg`` bytes [start, end), pool bytes [pstart, pend)
    reg = start = end = pstart = pend = 0
    last: GroupSpec | None = None
    run: tuple[int, int, int, int] | None = None  # the group's only template run, when it has one
    block_bytes = num_blocks = 0
    for group, block_ids, extents in entries:
        if group is not last:
            last = group
            template, block_bytes = _block_template(group)
            run = template[0] if len(template) == 1 and group.kind != "mamba" else None
            num_blocks = group.num_blocks
        # The fast path checks what ``_checked_template`` checks, inline: one run, one extent.
        if (run is None or len(extents) != 1 or extents[0][0] < 0 or not block_ids
                or extents[0][1] != len(block_ids) * block_bytes):
            for seg in segments_for_entry(group, block_ids, extents):  # checks, and raises with the reason
                if (is_open and seg.region_offset == end and seg.pool_offset == pend
                        and seg.region_id == reg):
                    end += seg.nbytes
                    pend += seg.nbytes
                else:
                    if is_open:
                        out.append(Segment(reg, start, pstart, end - start))
                    is_open = True
                    reg, start, pstart = seg.region_id, seg.region_offset, seg.pool_offset
                    end, pend = start + seg.nbytes, pstart + seg.nbytes
            continue
        region_id, base, stride, page = run
        pool_off = extents[0][0]
        for b in block_ids:
            if not 0 < b < num_blocks:
                group.validate_block_ids(block_ids)  # raises with the precise message
            roff = base + b * stride
            if is_open and roff == end and pool_off == pend and region_id == reg:
                end += page
                pend += page
            else:
                if is_open:
                    out.append(Segment(reg, start, pstart, end - start))
                is_open = True
                reg, start, end, pstart, pend = region_id, roff, roff + page, pool_off, pool_off + page
            pool_off += page
    if is_open:
        out.append(Segment(reg, start, pstart, end - start))
    return out


def segments_for_entry(
    group: GroupSpec, block_ids: Sequence[int], extents: Sequence[tuple[int, int]]
) -> list[Segment]:
    """Map an entry's pages (blocks, then views, then layers, then pieces) onto pool ``extents`` in order.

    Adjacent pieces are merged when both the engine side (same region, next byte) and the pool
    side (next byte) are contiguous: a block-major engine with a one-extent entry collapses to
    one segment per block run, and each segment is one iovec / one copy descriptor. The work
    per entry is one step per (block, template run), not per page (see ``_block_template``).
    """
    template, _ = _checked_template(group, block_ids, extents)
    if len(template) == 1 and len(extents) == 1:  # the common case: one run per block, one extent
        return _one_run_one_extent(template[0], block_ids, extents[0][0])

    # Output as parallel lists; built into Segments at the end (cheaper than replacing frozen objects).
    regs: list[int] = []
    roffs: list[int] = []
    poffs: list[int] = []
    sizes: list[int] = []
    ext_iter = iter(extents)
    ext_off, ext_left = next(ext_iter)

    for b in block_ids:
        for region_id, base, stride, page in template:
            roff = base + b * stride
            left = page
            while left:
                if ext_left == 0:
                    ext_off, ext_left = next(ext_iter)
                n = left if left <= ext_left else ext_left
                if (regs and regs[-1] == region_id and roffs[-1] + sizes[-1] == roff
                        and poffs[-1] + sizes[-1] == ext_off):
                    sizes[-1] += n
                else:
                    regs.append(region_id)
                    roffs.append(roff)
                    poffs.append(ext_off)
                    sizes.append(n)
                roff += n
                left -= n
                ext_off += n
                ext_left -= n
    return [Segment(r, ro, po, n) for r, ro, po, n in zip(regs, roffs, poffs, sizes, strict=True)]


def _one_run_one_extent(run: tuple[int, int, int, int], block_ids: Sequence[int], pool_offset: int) -> list[Segment]:
    """``segments_for_entry`` for one template run into one extent: the pool side is contiguous, so
    blocks merge exactly when they are adjacent on the engine side too."""
    region_id, base, stride, page = run
    out: list[Segment] = []
    start = end = -1  # engine-side bytes [start, end) of the open segment
    seg_pool = pool_offset
    for b in block_ids:
        roff = base + b * stride
        if roff != end:
            if end >= 0:
                out.append(Segment(region_id, start, seg_pool, end - start))
                seg_pool += end - start
            start = roff
        end = roff + page
    out.append(Segment(region_id, start, seg_pool, end - start))
    return out
