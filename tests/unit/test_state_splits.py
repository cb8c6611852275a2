"""The shim's state splits (``hkvd.shim.spec.state_splits``): GDN groups get how their conv and SSM states split
over TP ranks, derived from the model's config and checked against vLLM's per-rank shapes; other Mamba types and
shapes that do not match get none (their states are read at their TP size only)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build: make vllm")

import torch
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

from hkvd.shim.spec import state_splits

pytestmark = pytest.mark.vllm

NK, NV, DK, DV, KERNEL = 2, 4, 128, 128, 4  # tests/shim/tiny_models.py's qwen3_next_tp2


def vllm_config(tp: int, spec_tokens: int = 0) -> Any:
    text = SimpleNamespace(linear_num_key_heads=NK, linear_num_value_heads=NV, linear_key_head_dim=DK,
                           linear_value_head_dim=DV, linear_conv_kernel_dim=KERNEL)
    return SimpleNamespace(model_config=SimpleNamespace(hf_text_config=text),
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp),
                           speculative_config=SimpleNamespace(num_speculative_tokens=spec_tokens) if spec_tokens
                           else None)


def config(*mamba: MambaSpec) -> KVCacheConfig:
    full = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=128, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec(["full.0"], full)] + [KVCacheGroupSpec([f"gdn.{i}"], m) for i, m in enumerate(mamba)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def gdn(tp: int, kind: MambaAttentionBackendEnum = MambaAttentionBackendEnum.GDN_ATTN, num_spec: int = 0) -> MambaSpec:
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(tp, NK, NV, DK, DV, KERNEL, num_spec)
    return MambaSpec(block_size=128, shapes=tuple(shapes), dtypes=(torch.bfloat16, torch.float32), mamba_type=kind)


@pytest.mark.parametrize("tp", [1, 2])
def test_gdn_groups_get_their_splits_in_sd_and_ds(tp: int, monkeypatch: pytest.MonkeyPatch) -> None:
    kd, vd = NK * DK, NV * DV
    want = [(1, "gdn_attn", ((1, (kd, kd, vd)), (0, (NV,))))]
    assert state_splits(vllm_config(tp), config(gdn(tp))) == want
    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: True)
    assert gdn(tp).shapes[0] == ((2 * kd + vd) // tp, KERNEL - 1)  # vLLM's DS shape, as the shim reads the layout
    assert state_splits(vllm_config(tp), config(gdn(tp))) == [(1, "gdn_attn", ((0, (kd, kd, vd)), (0, (NV,))))]


def test_other_types_and_shapes_get_none() -> None:
    # A Mamba2 group: named, with no splits (refused by the daemon, naming the type).
    assert state_splits(vllm_config(1), config(gdn(1, MambaAttentionBackendEnum.MAMBA2))) == [(1, "mamba2", ())]
    # Shapes for another TP size, or for speculative tokens the config does not have: not described.
    assert state_splits(vllm_config(2), config(gdn(1))) == [(1, "gdn_attn", ())]
    assert state_splits(vllm_config(1), config(gdn(1, num_spec=2))) == [(1, "gdn_attn", ())]
    assert state_splits(vllm_config(1, spec_tokens=2), config(gdn(1, num_spec=2)))[0][2]
    # A config without the GDN sizes.
    bare = SimpleNamespace(model_config=SimpleNamespace(hf_text_config=SimpleNamespace()),
                           parallel_config=SimpleNamespace(tensor_parallel_size=1), speculative_config=None)
    assert state_splits(bare, config(gdn(1))) == [(1, "gdn_attn", ())]
    assert state_splits(vllm_config(1), config()) == []
