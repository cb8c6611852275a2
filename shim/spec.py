# SPDX-License-Identifier: Apache-2.0
"""The ``EngineSpec`` an engine registers, built from vLLM's objects, and vLLM's settings checked.

Role
    Both halves of the connector (scheduler side in EngineCore, worker side per rank) build the
    same spec, so they cannot drift apart. ``build_groups`` / ``build_engine_spec`` turn
    ``KVCacheConfig`` into our ``GroupSpec``/``View`` table. The scheduler side has no tensors, so
    it describes views from ``KVCacheConfig.kv_cache_tensors`` and the resolved layout; the worker
    side passes the address of every layer and the pieces that visit its page in the canonical
    order, read from its tensors and checked against the config (``hkvd.shim.kv_views``). Both emit
    one view per layer in ``group.layer_names`` order, so the format part (kind, tokens per block,
    window, dtype, (num_layers, page_bytes) per view) and hence the daemon's layout fingerprint are
    identical on both sides; the layout tag names the canonical page order, not the layout.

Errors
    ``validate_vllm`` raises ``ValueError`` with the fix for settings a restart with other flags
    fixes, so vLLM's startup fails with it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hkvd.shim.identity import engine_identity, model_identity
from hkvd.shim.kv_views import Pieces, config_place, layout_name, page_order
from hkvd.shim.shim_config import ShimConfig
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire.control import EngineSpec, StateSplits

if TYPE_CHECKING:  # vLLM's and torch's types, for annotations only (vLLM is imported where it is used)
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec

    from hkvd.transport.copy_engine import Region

logger = logging.getLogger("hkvd.shim")

# The sizes a chunk may take are checked by the daemon; the shim only needs vLLM's side.
_KIND_FULL, _KIND_SWA, _KIND_MAMBA = "full", "swa", "mamba"


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """What the scheduler needs to turn a block table into items, per KV-cache group."""

    group_id: int
    kind: str  # full | swa | mamba
    block_size: int  # tokens per block
    window_tokens: int  # swa only, else 0


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).removeprefix("torch.")


def group_infos(kv_cache_config: KVCacheConfig) -> list[GroupInfo]:
    """Classify vLLM's KV-cache groups; raise (with the fix) on kinds hkvd cannot cache."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    out = []
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        s = g.kv_cache_spec
        if isinstance(s, MambaSpec):
            out.append(GroupInfo(gid, _KIND_MAMBA, s.block_size, 0))
        elif isinstance(s, SlidingWindowSpec):
            out.append(GroupInfo(gid, _KIND_SWA, s.block_size, int(s.sliding_window)))
        elif isinstance(s, FullAttentionSpec):
            # With the hybrid manager off, vLLM marks SWA layers as FullAttentionSpec with a
            # sliding_window; their blocks are all kept, so "full" is exact for them too.
            out.append(GroupInfo(gid, _KIND_FULL, s.block_size, 0))
        else:
            raise ValueError(
                f"hkvd: KV-cache group {gid} ({type(s).__name__}, layers {g.layer_names[:3]}...) is not a "
                "kind hkvd caches (full attention, sliding window, Mamba/GDN). Remove the hkvd "
                "kv_transfer_config for this model."
            )
    return out


def _page_and_dtype(spec: KVCacheSpec) -> tuple[int, str]:
    from vllm.v1.kv_cache_interface import AttentionSpec, MambaSpec

    if isinstance(spec, MambaSpec):
        # The real state bytes only: the padding up to the attention page size is never read.
        shapes = ";".join(f"{_dtype_name(d)}{list(s)}" for s, d in zip(spec.shapes, spec.dtypes, strict=True))
        return int(spec.real_page_size_bytes), f"state:{shapes}"
    if not isinstance(spec, AttentionSpec):  # group_infos refused every other kind before this
        raise ValueError(f"hkvd: a {type(spec).__name__} group has no page format hkvd knows")
    return int(spec.real_page_size_bytes), _dtype_name(spec.dtype)


# layer name -> (region_id, byte offset of its page of block 0 in the region, the page's pieces in canonical order)
LayerAddr = Callable[[str], tuple[int, int, "Pieces"]]


def build_groups(kv_cache_config: KVCacheConfig, layer_addr: LayerAddr | None = None,
                 layout: str | None = None) -> list[GroupSpec]:
    """Our ``GroupSpec`` list: one ``View`` per layer, in ``group.layer_names`` order.

    ``layer_addr=None`` (scheduler side) places layer l of a ``KVCacheTensor`` at
    ``offset + l * layer_stride`` of region 0, without pieces: only the format matters for a
    lookup-only registration. The worker passes the (region, offset, pieces) of each layer's page
    of block 0, which it read from and checked against its tensors; a page that is one run gets no
    pieces. ``layout``: vLLM's resolved ``VLLM_KV_CACHE_LAYOUT``.
    """

    tensors = {name: t for t in kv_cache_config.kv_cache_tensors for name in t.layers}
    infos = group_infos(kv_cache_config)
    groups = []
    for info, g in zip(infos, kv_cache_config.kv_cache_groups, strict=True):
        page_bytes, dtype = _page_and_dtype(g.kv_cache_spec)
        num_blocks = int(kv_cache_config.num_blocks)
        views: list[View] = []
        for name in g.layer_names:
            t = tensors.get(name)
            if t is None:
                raise ValueError(f"hkvd: layer {name} of group {info.group_id} has no KVCacheTensor")
            place = config_place(name, g.kv_cache_spec, layout, t, num_blocks)
            if sum(n for _, n in place.pieces) != page_bytes:
                raise ValueError(f"hkvd: layer {name} (KV-cache layout {layout}): its pages hold "
                                 f"{sum(n for _, n in place.pieces)} B by the layout but {page_bytes} B by its "
                                 "spec. Remove the hkvd kv_transfer_config for this model.")
            region_id, offset, pieces = layer_addr(name) if layer_addr else (0, place.start, ())
            if sum(n for _, n in pieces or place.pieces) != page_bytes:
                raise ValueError(f"hkvd: layer {name}: the worker's pieces {list(pieces)[:4]} do not hold its "
                                 f"{page_bytes} B page. Remove the hkvd kv_transfer_config for this model.")
            views.append(View(region_id, offset, 1, place.block_stride * num_blocks, place.block_stride, page_bytes,
                              () if pieces == ((0, page_bytes),) else tuple(pieces)))
        groups.append(GroupSpec(
            group_id=info.group_id, kind=info.kind, tokens_per_block=info.block_size,
            window_tokens=info.window_tokens, num_blocks=int(kv_cache_config.num_blocks), dtype=dtype,
            views=tuple(views),
        ))
    return groups


def resolved_layout(vllm_config: VllmConfig | None, kv_cache_config: KVCacheConfig) -> str | None:
    """The KV-cache layout vLLM resolved (``KVCacheConfig.kv_cache_layout``, else the cache config's)."""

    name = getattr(kv_cache_config, "kv_cache_layout", None)
    if name is None and vllm_config is not None:
        name = getattr(vllm_config.cache_config, "kv_cache_layout", None)
    return layout_name(name)


def validate_vllm(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: ShimConfig) -> None:
    """Checks on vLLM's own settings that make hkvd useless or wrong; raise with the fix."""
    infos = group_infos(kv_cache_config)
    cache = vllm_config.cache_config
    has_mamba = any(i.kind == _KIND_MAMBA for i in infos)
    if has_mamba and (not cache.enable_prefix_caching or getattr(cache, "mamba_cache_mode", "none") != "align"):
        raise ValueError(
            "hkvd: this model has Mamba/GDN layers; hkvd stores their states only in vLLM's align "
            "mode. Start vLLM with --enable-prefix-caching --mamba-cache-mode align."
        )
    pp = int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1))
    if pp > 1:
        raise ValueError(
            f"hkvd: pipeline_parallel_size={pp} is not supported (each stage holds other layers, and hkvd "
            "keys entries per tensor-parallel rank only). Serve with pipeline_parallel_size=1 (tensor "
            "parallelism is supported), or remove the hkvd kv_transfer_config."
        )
    block = int(cache.block_size)
    if cfg.chunk_size and cfg.chunk_size % block:
        raise ValueError(
            f"hkvd: chunk_size {cfg.chunk_size} is not a multiple of vLLM's block size N={block}; "
            f"set kv_connector_extra_config chunk_size (and hkvd serve --chunk-size) to {block} or a "
            "multiple of it."
        )
    for i in infos:
        if i.block_size != block:
            raise ValueError(
                f"hkvd: group {i.group_id} uses block size {i.block_size}, not the unified {block}; "
                "hkvd needs one block size across groups (keep the hybrid KV-cache manager on)."
            )


def effective_chunk_size(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: ShimConfig) -> int:
    """The chunk size the shim registers: ``chunk_size`` if set, else vLLM's block size N.

    vLLM's own prefix cache hits at block granularity; a chunk of k blocks rounds every hit down to a
    multiple of k blocks. A prompt whose last full block starts a chunk the prompt does not fill
    (950 tokens, N=128, chunks of 256: [768, 1024)) leaves that block to vLLM alone, and the next
    turn gets 768 tokens from hkvd where vLLM's own cache serves 896. Mamba states exist only at
    block boundaries, so there a coarser chunk also loses every boundary between chunks.
    """
    del kv_cache_config  # every model gets N; the argument stays for the callers' symmetry
    return cfg.chunk_size or int(vllm_config.cache_config.block_size)


def layout_tag(kv_cache_config: KVCacheConfig, vllm_config: VllmConfig | None = None) -> str:
    """The device type and the canonical page order entries hold (``hkvd.shim.kv_views.page_order``), e.g.
    ``cpu/HNC``: engines of one model whose layouts or kernel block sizes differ share entries when it matches."""
    from vllm.platforms import current_platform


    return f"{current_platform.device_type}/{page_order(resolved_layout(vllm_config, kv_cache_config))}"


def _worker_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not initialised (tests driving the worker half directly): single rank
        return 0


def build_engine_spec(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, cfg: ShimConfig, *, regions: list[Region],
    layer_addr: LayerAddr | None,
) -> EngineSpec:

    par = vllm_config.parallel_config
    return EngineSpec(
        model=str(vllm_config.model_config.model),
        world_size=int(par.world_size),
        # The scheduler looks up with rank 0's format; each worker registers its own rank.
        rank=_worker_rank() if layer_addr else 0,
        layout_tag=layout_tag(kv_cache_config, vllm_config),
        chunk_size=effective_chunk_size(vllm_config, kv_cache_config, cfg),
        block_size=int(vllm_config.cache_config.block_size),
        max_num_batched_tokens=int(vllm_config.scheduler_config.max_num_batched_tokens),
        mamba_cache_mode=str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none")),
        regions=regions,
        groups=build_groups(kv_cache_config, layer_addr, resolved_layout(vllm_config, kv_cache_config)),
        identity=engine_identity(vllm_config),
        event_groups=event_groups(kv_cache_config),
        model_identity=model_identity(vllm_config),
        heads=head_splits(vllm_config, kv_cache_config),
        states=state_splits(vllm_config, kv_cache_config),
        replicated=replicated_groups(vllm_config, kv_cache_config),
    )


def replicated_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> list[int]:
    """The groups whose pages hold the same bytes on every tensor-parallel rank: vLLM's MLA latent cache (one
    head, written from replicated projections), unless decode or prefill context parallelism splits its tokens
    over the ranks. The daemon stores a world whose every group is one of these once per node
    (docs/design.md, "Replicated groups (MLA)")."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    par = vllm_config.parallel_config
    if (int(getattr(par, "decode_context_parallel_size", 1) or 1) > 1
            or int(getattr(par, "prefill_context_parallel_size", 1) or 1) > 1):
        return []
    groups = kv_cache_config.kv_cache_groups
    return [gid for gid, g in enumerate(groups) if isinstance(g.kv_cache_spec, MLAAttentionSpec)]


def head_splits(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> list[tuple[int, int, int, int]]:
    """Per attention group whose pages are one slot per KV head (full attention, sliding window; not MLA, not
    packed or quantized slots): (group id, KV heads on this rank, KV heads in the model, states per page), what
    the daemon needs to re-shard its entries for an engine of another TP size (transport/reshard.py)."""
    from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    try:
        total = int(vllm_config.model_config.get_total_num_kv_heads())
    except Exception:  # a config vLLM cannot count heads of: nothing is re-sharded
        return []
    out = []
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        s = g.kv_cache_spec
        if (not isinstance(s, AttentionSpec) or isinstance(s, MLAAttentionSpec)
                or getattr(s, "num_head_slots", None) is not None or getattr(s, "state_content_bytes", None) is not None
                or not getattr(s, "has_layer_views", True)):
            continue
        out.append((gid, int(s.num_kv_heads), total, int(s.num_states)))
    return out


def state_splits(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> list[StateSplits]:
    """Per Mamba group: (group id, vLLM's Mamba type in lower case, how each state splits over TP ranks), what the
    daemon needs to re-shard its states for an engine of another TP size (transport/state_shards.py). The splits
    are given for GDN groups whose per-rank shapes are the ones ``_gdn_splits`` computes from the model's config;
    any other type (and a GDN group that does not match) gets none, so its states are read at its TP size only."""
    from vllm.v1.kv_cache_interface import MambaSpec

    out: list[StateSplits] = []
    for gid, g in enumerate(kv_cache_config.kv_cache_groups):
        s = g.kv_cache_spec
        if not isinstance(s, MambaSpec):
            continue
        kind = str(getattr(getattr(s, "mamba_type", None), "name", "unknown")).lower()[:64]
        splits = () if kind != "gdn_attn" or getattr(s, "tp_replicated", False) else _gdn_splits(vllm_config, s)
        out.append((gid, kind, splits))
    return out


def _gdn_splits(vllm_config: VllmConfig, spec: KVCacheSpec) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """A GDN layer's two states as vLLM 0.32 lays them on a rank of tp: the conv state (state_len, conv_dim / tp)
    ("SD", vLLM's default conv layout) or (conv_dim / tp, state_len) ("DS"), its dim the rank's q, k and v
    channels one after another (vLLM loads conv1d's weight so: each of q, k, v split evenly over the ranks);
    the SSM state (num_v_heads / tp, head_v_dim, head_k_dim), the rank's value heads. () when the config does not
    name the GDN sizes or the spec's shapes are not these."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        cfg = vllm_config.model_config.hf_text_config
        nk, nv = int(cfg.linear_num_key_heads), int(cfg.linear_num_value_heads)
        dk, dv, kernel = int(cfg.linear_key_head_dim), int(cfg.linear_value_head_dim), int(cfg.linear_conv_kernel_dim)
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        spec_cfg = vllm_config.speculative_config
        state_len = kernel - 1 + (int(spec_cfg.num_speculative_tokens or 0) if spec_cfg else 0)
        dim_first = bool(is_conv_state_dim_first())
        shapes = [tuple(int(d) for d in shape) for shape in spec.shapes]  # type: ignore[attr-defined]
    except Exception:  # a config or a vLLM without these names: not described
        return ()
    key_dim, value_dim = nk * dk, nv * dv
    if tp < 1 or key_dim % tp or value_dim % tp or nv % tp:
        return ()
    conv_dim = (2 * key_dim + value_dim) // tp
    conv = (conv_dim, state_len) if dim_first else (state_len, conv_dim)
    if shapes != [conv, (nv // tp, dv, dk)]:
        return ()
    return ((0 if dim_first else 1, (key_dim, key_dim, value_dim)), (0, (nv,)))


def event_groups(kv_cache_config: KVCacheConfig) -> list[tuple[int, str, int | None]]:
    """How vLLM names each KV-cache group in its KV events: (group index, kv_cache_spec_kind, sliding window),
    as its KV-cache manager annotates its own ``BlockStored`` events. [] with a vLLM that names none."""
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
    except ImportError:
        return []
    return [(gid, str(get_kv_cache_spec_kind(g.kv_cache_spec).value),
             get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for gid, g in enumerate(kv_cache_config.kv_cache_groups)]
