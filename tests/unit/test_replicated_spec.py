"""The shim's side of replicated groups: vLLM's own ``MLAAttentionSpec`` groups are marked replicated (their pages
are the same latent bytes on every tensor-parallel rank), other kinds are not, and context parallelism (which
spreads a sequence's tokens over the ranks) marks none (docs/design.md, "Replicated groups (MLA)")."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build: make vllm")

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from hkvd.shim.spec import build_groups, head_splits, replicated_groups

LATENT = 512 + 64  # kv_lora_rank + qk_rope_head_dim: DeepSeek-V2/V3's latent, one "head" per token


def mla() -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=LATENT, dtype=torch.bfloat16)


def config(*specs: KVCacheSpec) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"layer.{i}"], s) for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def vllm_config(dcp: int = 1, pcp: int = 1) -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=2, decode_context_parallel_size=dcp,
                                                           prefill_context_parallel_size=pcp))


def test_mla_groups_are_marked_replicated_and_other_kinds_are_not() -> None:
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=128, dtype=torch.bfloat16, sliding_window=64)
    assert replicated_groups(vllm_config(), config(mla())) == [0]
    assert replicated_groups(vllm_config(), config(full, mla(), swa)) == [1]
    assert replicated_groups(vllm_config(), config(full, swa)) == []


@pytest.mark.parametrize(("dcp", "pcp"), [(2, 1), (1, 2)])
def test_context_parallelism_marks_no_group(dcp: int, pcp: int) -> None:
    assert replicated_groups(vllm_config(dcp, pcp), config(mla())) == []


def test_an_mla_group_is_one_latent_page_per_block_and_gets_no_head_split() -> None:
    from vllm.v1.kv_cache_interface import KVCacheTensor

    cfg = config(mla())
    page = 16 * LATENT * 2  # block 16, bfloat16
    assert int(mla().real_page_size_bytes) == page
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[KVCacheTensor(8 * page, ["layer.0"], 0, page)],
                        kv_cache_groups=cfg.kv_cache_groups)
    (g,) = build_groups(cfg, None, None)
    assert (g.kind, g.tokens_per_block, g.dtype) == ("full", 16, "bfloat16")
    assert [(v.num_layers, v.page_bytes) for v in g.views] == [(1, page)]
    # Not re-sharded by heads: the same page on every rank.
    model = SimpleNamespace(get_total_num_kv_heads=lambda: 1)
    assert head_splits(SimpleNamespace(model_config=model), cfg) == []  # type: ignore[arg-type]
