# SPDX-License-Identifier: Apache-2.0
"""Where one layer's page of one manager block lives: derived from vLLM's config, checked on its tensors.

Role
    vLLM 0.32/0.33 place every layer of a ``KVCacheTensor`` in one backing allocation: the page of
    layer l, manager block b *starts* at ``offset + l*layer_stride + b*block_stride``. Inside a
    page the logical cells are ``[H, N, C]`` (heads, stored states, content bytes: K and V of a
    cell are adjacent), in the physical order ``VLLM_KV_CACHE_LAYOUT`` resolves to. A page is one
    contiguous run when H, N and C are all inside both the layer and block dims (LBHNC, LBNHC,
    BLHNC, BLNHC); LHBNC and BHLNC put the head dim outside the block (or layer) dim, so a page is
    H runs of N*C bytes.

    ``page_pieces`` derives those runs from the config alone (the scheduler side has no tensors);
    both halves of the connector describe each page with one ``View`` per piece, so the format
    (and the daemon's layout fingerprint) is the same on both. ``check_layer_tensor`` reads the
    worker's tensor (data pointer, shape, strides) independently, maps kernel blocks back to
    manager blocks (a backend that cannot take the manager block size gets views whose dim 0
    counts ``ratio`` kernel blocks per manager block), and refuses unless the tensor's bytes for a
    manager block are exactly the derived pieces at the derived place.

    Specs without per-layer views (``has_layer_views`` false) get vLLM's raw backing buffer; their
    page is taken as the contiguous ``page_size_bytes`` at the config's start, and only the
    buffer's bounds are checked.

Failure
    ``ValueError`` naming the layer, the layout and the fix; raised from ``register_kv_caches`` so
    vLLM's start-up fails with it. Never a guessed offset.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # vLLM's and torch's types, for annotations only
    import torch
    from vllm.v1.kv_cache_interface import KVCacheSpec, KVCacheTensor

# Physical order of the logical dims (L, B, H, N, C) for each layout vLLM 0.32/0.33 resolve to.
LAYOUT_ORDERS: dict[str, str] = {
    "LBHNC": "LBHNC", "LBNHC": "LBNHC", "LHBNC": "LHBNC",
    "BLHNC": "BLHNC", "BLNHC": "BLNHC", "BHLNC": "BHLNC",
}
ALIASES = {"NHD": "LBNHC", "HND": "LBHNC"}  # vLLM's legacy names
MAX_PIECES = 256  # per page; beyond this a page is too scattered to copy one run at a time
WHOLE_PAGE_LAYOUTS = "LBHNC, LBNHC, BLHNC or BLNHC"
Pieces = tuple[tuple[int, int], ...]  # (byte offset from the page's start, bytes), ascending


@dataclass(frozen=True, slots=True)
class LayerPlace:
    """One layer's place in its ``KVCacheTensor``: page of block b starts at ``start + b*block_stride``."""

    start: int  # bytes from the backing allocation's start
    block_stride: int
    pieces: Pieces


def layout_name(name: str | None) -> str | None:
    """vLLM's resolved layout name, legacy aliases mapped; None when not resolved."""
    if name is None:
        return None
    name = ALIASES.get(name, name)
    if name not in LAYOUT_ORDERS:
        raise ValueError(f"hkvd: unknown KV-cache layout {name!r} (known: {sorted(LAYOUT_ORDERS)}); this "
                         "vLLM is newer than hkvd knows. Set VLLM_KV_CACHE_LAYOUT=LBHNC (CPU) or LBNHC.")
    return name


def _merge(runs: list[tuple[int, int]]) -> Pieces:
    out: list[list[int]] = []
    for off, n in sorted(runs):
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += n
        elif out and out[-1][0] + out[-1][1] > off:
            raise ValueError(f"overlapping bytes at offset {off}")
        else:
            out.append([off, n])
    return tuple((o, n) for o, n in out)


def _strides(spec: KVCacheSpec, layout: str, tensor: KVCacheTensor, num_blocks: int,
             ratio: int = 1) -> tuple[dict[str, int], dict[str, int]]:
    """(sizes, byte strides) of the logical dims L, B, H, N, C; B and N counted in kernel blocks of
    ``N / ratio`` states. Each dim's stride is the extent of the dims physically inside it, except L
    and B, whose strides the ``KVCacheTensor`` fixes (padding lives only in those)."""
    sizes = {"L": len(tensor.layers), "B": num_blocks * ratio, "H": int(spec.num_heads),
             "N": int(spec.num_states) // ratio, "C": int(spec.state_content_size_bytes)}
    strides: dict[str, int] = {}
    extent = 1
    for dim in reversed(LAYOUT_ORDERS[layout]):
        strides[dim] = {"L": int(tensor.layer_stride), "B": int(tensor.block_stride) // ratio}.get(dim, extent)
        extent = strides[dim] * sizes[dim]
    return sizes, strides


def _runs(dims: list[tuple[int, int]], unit: int, limit: int) -> Pieces:
    """The byte runs of the index space ``dims`` ((size, byte stride) each) of ``unit``-byte cells, merged.

    Dims are coalesced (by stride, outermost first) before the rest is walked, so one run costs one step.
    """
    merged: list[list[int]] = []
    for n, st in sorted(((n, st) for n, st in dims if n > 1), key=lambda d: -d[1]):
        if merged and merged[-1][1] == st * n:
            merged[-1] = [merged[-1][0] * n, st]
        else:
            merged.append([n, st])
    run = unit
    if merged and merged[-1][1] == unit:
        run = merged[-1][0] * unit
        merged.pop()
    count = 1
    for n, _ in merged:
        count *= n
    if count > limit:
        raise ValueError(f"a page is {count} separate pieces (at most {MAX_PIECES} are taken)")
    return _merge([(sum(i * st for i, (_, st) in zip(idx, merged, strict=True)), run)
                   for idx in itertools.product(*(range(n) for n, _ in merged))])


def page_pieces(spec: KVCacheSpec, layout: str | None, tensor: KVCacheTensor, num_blocks: int) -> Pieces:
    """The contiguous runs of one layer's page of one manager block, from the config alone."""
    if not getattr(spec, "has_layer_views", True) or layout is None:
        return ((0, int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))),)
    sizes, strides = _strides(spec, layout, tensor, num_blocks)
    return _runs([(sizes["H"], strides["H"]), (sizes["N"], strides["N"]), (sizes["C"], 1)], 1, MAX_PIECES)


def tensor_pieces(t: torch.Tensor, ratio: int) -> tuple[int, Pieces]:
    """(manager block stride, runs of manager block 0 from ``t.data_ptr()``) read from the tensor itself.

    Dim 0 counts ``ratio`` kernel blocks per manager block (1: manager blocks)."""
    es = int(t.element_size())
    kstride = int(t.stride(0)) * es
    dims = [(ratio, kstride)] + [(int(n), int(st) * es) for n, st in zip(t.shape[1:], t.stride()[1:], strict=True)]
    return kstride * ratio, _runs(dims, es, MAX_PIECES * ratio)


def _refuse(name: str, layout: str | None, what: str, fix: str) -> ValueError:
    return ValueError(f"hkvd: layer {name} (KV-cache layout {layout or 'unresolved'}): {what}. {fix}")


def config_place(name: str, spec: KVCacheSpec, layout: str | None, tensor: KVCacheTensor,
                 num_blocks: int) -> LayerPlace:
    """Where layer ``name`` of ``tensor`` lives, from the config alone (both halves of the connector)."""
    idx = tensor.layers.index(name)
    try:
        pieces = page_pieces(spec, layout, tensor, num_blocks)
    except ValueError as e:
        raise _refuse(name, layout, str(e),
                      f"Set VLLM_KV_CACHE_LAYOUT to {WHOLE_PAGE_LAYOUTS}, which keep each page whole.") from None
    return LayerPlace(int(tensor.offset) + idx * int(tensor.layer_stride), int(tensor.block_stride), pieces)


def check_layer_tensor(name: str, t: torch.Tensor, place: LayerPlace, spec: KVCacheSpec, layout: str | None,
                       kvt: KVCacheTensor, num_blocks: int) -> int:
    """Check the worker's tensor for layer ``name`` against the config's ``place`` (vLLM's backing allocation
    is the tensor's whole storage); return the byte offset of the layer's page of block 0 in that storage."""
    alloc_size = int(kvt.size)
    base = int(t.untyped_storage().data_ptr())
    here = int(t.data_ptr()) - base
    mismatch = ("Its tensor is not the allocation vLLM's allocate_kv_cache makes for this KVCacheConfig; hkvd "
                "cannot tell where its blocks are. Remove the hkvd kv_transfer_config for this engine.")
    if not getattr(spec, "has_layer_views", True):
        # The raw backing buffer: the spec lays out its own pages; the config's placement is all there is.
        if here != 0:
            raise _refuse(name, layout, f"its raw buffer starts at byte {here} of its storage", mismatch)
        end = place.start + (num_blocks - 1) * place.block_stride + place.pieces[-1][0] + place.pieces[-1][1]
        if int(t.numel()) * int(t.element_size()) < alloc_size or end > int(t.untyped_storage().nbytes()):
            raise _refuse(name, layout, f"its raw buffer ({t.numel() * t.element_size()} B) is smaller than "
                          f"the KVCacheTensor's {alloc_size} B", mismatch)
        return place.start
    if t.dim() < 1 or int(t.shape[0]) % num_blocks:
        raise _refuse(name, layout, f"dim 0 of its tensor {tuple(t.shape)} is not a multiple of the "
                      f"{num_blocks} blocks", mismatch)
    ratio = int(t.shape[0]) // num_blocks
    try:
        stride, pieces = tensor_pieces(t, ratio)
    except ValueError as e:
        raise _refuse(name, layout, f"its tensor {tuple(t.shape)} with strides {t.stride()}: {e}",
                      f"Set VLLM_KV_CACHE_LAYOUT to {WHOLE_PAGE_LAYOUTS}, which keep each page whole.") from None
    if stride != place.block_stride:
        raise _refuse(name, layout, f"a manager block is {stride} B apart in its tensor ({ratio} kernel block(s) "
                      f"of {stride // ratio} B) but {place.block_stride} B in KVCacheConfig", mismatch)
    if pieces != place.pieces:
        raise _refuse(name, layout, f"a page is the runs {list(pieces)[:4]} in its tensor but "
                      f"{list(place.pieces)[:4]} by the layout", mismatch)
    if layout is not None and t.dim() == 4:  # vLLM's [B, H, N, C] view: the order inside a page too
        sizes, strides = _strides(spec, layout, kvt, num_blocks, ratio)
        es = int(t.element_size())
        for axis, dim in ((1, "H"), (2, "N")):
            if int(t.shape[axis]) != sizes[dim] or (sizes[dim] > 1 and int(t.stride(axis)) * es != strides[dim]):
                raise _refuse(name, layout, f"its tensor {tuple(t.shape)} with strides {t.stride()} orders a "
                              f"page's {dim} dim unlike the layout", mismatch)
    if here != place.start:
        raise _refuse(name, layout, f"its tensor starts at byte {here} of its allocation but KVCacheConfig "
                      f"places it at byte {place.start}", mismatch)
    return here
