# SPDX-License-Identifier: Apache-2.0
"""Where one layer's page of one manager block lives, and in what order its bytes go to an entry.

Role
    vLLM 0.32/0.33 place every layer of a ``KVCacheTensor`` in one backing allocation: the page of
    layer l, manager block b *starts* at ``offset + l*layer_stride + b*block_stride``. Inside a
    page the logical cells are ``[H, N, C]`` (heads, stored states, content bytes: K and V of a
    cell are adjacent; Mamba and MLA pages have H = 1, Mamba N = 1), in the physical order
    ``VLLM_KV_CACHE_LAYOUT`` resolves to, and a backend that cannot take the manager block size
    splits the page into k kernel blocks of N/k states each.

    An entry holds a page in one canonical order whatever the layout and k: ``[H, N, C]`` for the
    layouts with the head dim outside the token dim (LBHNC, LHBNC, BLHNC, BHLNC), ``[N, H, C]``
    for the others (LBNHC, BLNHC). Each is the order its layouts keep whole at k = 1, so the common
    engines copy one run per page; the order's name is in the layout tag, and so in the daemon's
    fingerprint. The worker lists, per layer, the pieces (offset from the page start, bytes) that
    visit its page in that order: H pieces under LHBNC/BHLNC, H*k under LBHNC/BLHNC split into k
    kernel blocks.

    ``config_pieces`` derives them from the config, the layout and the kernel split;
    ``tensor_pieces`` reads them from the worker's tensor (data pointer, shape, strides);
    ``check_layer_tensor`` refuses unless both agree and the tensor is where the config puts it.
    The scheduler side (no tensors, no kernel block size) registers one view per layer without
    pieces: the same format.

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
MAX_PIECES = 1024  # per page; beyond this a page is too scattered to copy one run at a time
WHOLE_PAGE_LAYOUTS = ("LBNHC or BLNHC (LBHNC or BLHNC also keep a page whole when the attention backend takes "
                      "the block size unsplit; vLLM's CPU backend takes only LBHNC)")
Pieces = tuple[tuple[int, int], ...]  # (byte offset from the page's start, bytes), in canonical order


@dataclass(frozen=True, slots=True)
class LayerPlace:
    """One layer's place in its ``KVCacheTensor``: page of block b starts at ``start + b*block_stride``."""

    start: int  # bytes from the backing allocation's start
    block_stride: int
    pieces: Pieces  # at the kernel split it was derived for (1 on the scheduler side)


def layout_name(name: str | None) -> str | None:
    """vLLM's resolved layout name, legacy aliases mapped; None when not resolved."""
    if name is None:
        return None
    name = ALIASES.get(name, name)
    if name not in LAYOUT_ORDERS:
        raise ValueError(f"hkvd: unknown KV-cache layout {name!r} (known: {sorted(LAYOUT_ORDERS)}); this "
                         "vLLM is newer than hkvd knows. Set VLLM_KV_CACHE_LAYOUT=LBHNC (CPU) or LBNHC.")
    return name


def page_order(layout: str | None) -> str:
    """The canonical order of a page's cells in an entry under ``layout``: "HNC" or "NHC"."""
    if layout is None:
        return "HNC"  # unresolved: the default layout (LBHNC on CPU), and H = N = 1 raw pages
    order = LAYOUT_ORDERS[layout]
    return "HNC" if order.index("H") < order.index("N") else "NHC"


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
    """The byte runs of the index space ``dims`` ((size, byte stride) each, outermost first: the order
    the runs are visited in) of ``unit``-byte cells, adjacent runs merged. Dims that continue the next
    inner one are coalesced first, so one run costs one step."""
    merged: list[list[int]] = []
    for n, st in ((n, st) for n, st in dims if n > 1):
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
        raise ValueError(f"a page is {count} separate pieces (at most {limit} are taken)")
    out: list[list[int]] = []
    for idx in itertools.product(*(range(n) for n, _ in merged)):
        off = sum(i * st for i, (_, st) in zip(idx, merged, strict=True))
        if out and out[-1][0] + out[-1][1] == off:
            out[-1][1] += run
        else:
            out.append([off, run])
    return tuple((o, n) for o, n in out)


def _canonical(order: str, k: tuple[int, int], h: tuple[int, int], n: tuple[int, int],
               c: tuple[int, int], unit: int) -> Pieces:
    """Runs visiting a page's cells in ``order``: k kernel blocks of n states (both making up N), h heads,
    c content; (size, byte stride) each."""
    dims = [h, k, n, c] if order == "HNC" else [k, n, h, c]
    return _runs(dims, unit, MAX_PIECES)


def config_pieces(spec: KVCacheSpec, layout: str | None, tensor: KVCacheTensor, num_blocks: int,
                  ratio: int = 1) -> Pieces:
    """A layer's page of one manager block in canonical order, from the config, split in ``ratio`` kernel blocks."""
    if not getattr(spec, "has_layer_views", True) or layout is None:
        return ((0, int(getattr(spec, "real_page_size_bytes", spec.page_size_bytes))),)
    sizes, strides = _strides(spec, layout, tensor, num_blocks, ratio)
    return _canonical(page_order(layout), (ratio, strides["B"]), (sizes["H"], strides["H"]),
                      (sizes["N"], strides["N"]), (sizes["C"], 1), 1)


def tensor_pieces(t: torch.Tensor, ratio: int, order: str) -> tuple[int, Pieces]:
    """(manager block stride, canonical runs of manager block 0 from ``t.data_ptr()``) read from the tensor.

    ``t`` is vLLM's ``[B, H, N, C]`` view; dim 0 counts ``ratio`` kernel blocks per manager block (1:
    manager blocks). Another shape must be one contiguous run per manager block."""
    es = int(t.element_size())
    kstride = int(t.stride(0)) * es
    dims = [(int(n), int(st) * es) for n, st in zip(t.shape[1:], t.stride()[1:], strict=True)]
    if t.dim() == 4:
        return kstride * ratio, _canonical(order, (ratio, kstride), dims[0], dims[1], dims[2], es)
    runs = _runs([(ratio, kstride), *sorted(dims, key=lambda d: -d[1])], es, 1)
    return kstride * ratio, runs


def _refuse(name: str, layout: str | None, what: str, fix: str) -> ValueError:
    return ValueError(f"hkvd: layer {name} (KV-cache layout {layout or 'unresolved'}): {what}. {fix}")


def _scattered(name: str, layout: str | None, e: ValueError) -> ValueError:
    return _refuse(name, layout, str(e), f"Set VLLM_KV_CACHE_LAYOUT to {WHOLE_PAGE_LAYOUTS}.")


def config_place(name: str, spec: KVCacheSpec, layout: str | None, tensor: KVCacheTensor,
                 num_blocks: int, ratio: int = 1) -> LayerPlace:
    """Where layer ``name`` of ``tensor`` lives, from the config alone (both halves of the connector)."""
    idx = tensor.layers.index(name)
    try:
        pieces = config_pieces(spec, layout, tensor, num_blocks, ratio)
    except ValueError as e:
        raise _scattered(name, layout, e) from None
    return LayerPlace(int(tensor.offset) + idx * int(tensor.layer_stride), int(tensor.block_stride), pieces)


def check_layer_tensor(name: str, t: torch.Tensor, place: LayerPlace, spec: KVCacheSpec, layout: str | None,
                       kvt: KVCacheTensor, num_blocks: int) -> tuple[int, Pieces]:
    """Check the worker's tensor for layer ``name`` against the config's ``place`` (vLLM's backing allocation
    is the tensor's whole storage); return the byte offset of the layer's page of block 0 in that storage and
    the page's pieces in canonical order, read from the tensor and equal to what the config and layout say
    for the tensor's kernel split."""
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
        return place.start, place.pieces
    if t.dim() < 1 or int(t.shape[0]) % num_blocks:
        raise _refuse(name, layout, f"dim 0 of its tensor {tuple(t.shape)} is not a multiple of the "
                      f"{num_blocks} blocks", mismatch)
    ratio = int(t.shape[0]) // num_blocks
    if ratio > 1:  # the config's pieces at the tensor's kernel split
        place = config_place(name, spec, layout, kvt, num_blocks, ratio)
    if layout is not None and t.dim() == 4:  # vLLM's [B, H, N, C] view: which dim is which
        sizes, _ = _strides(spec, layout, kvt, num_blocks, ratio)
        if (int(t.shape[1]), int(t.shape[2])) != (sizes["H"], sizes["N"]):
            raise _refuse(name, layout, f"its tensor {tuple(t.shape)} is not [blocks, {sizes['H']} heads, "
                          f"{sizes['N']} states, content]", mismatch)
    try:
        stride, pieces = tensor_pieces(t, ratio, page_order(layout))
    except ValueError as e:
        raise _scattered(name, layout, ValueError(f"its tensor {tuple(t.shape)} with strides {t.stride()}: {e}")) \
            from None
    if stride != place.block_stride:
        raise _refuse(name, layout, f"a manager block is {stride} B apart in its tensor ({ratio} kernel block(s) "
                      f"of {stride // ratio} B) but {place.block_stride} B in KVCacheConfig", mismatch)
    if pieces != place.pieces:
        raise _refuse(name, layout, f"a page is the runs {list(pieces)[:4]} in its tensor but "
                      f"{list(place.pieces)[:4]} by the layout", mismatch)
    if here != place.start:
        raise _refuse(name, layout, f"its tensor starts at byte {here} of its allocation but KVCacheConfig "
                      f"places it at byte {place.start}", mismatch)
    return here, pieces
