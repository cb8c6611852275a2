"""The TP-free model identity (``hkvd.shim.identity.model_identity``): the same at every TP size, so the daemon
can tell that worlds of different TP sizes hold the same model (transport/reshard.py)."""

from __future__ import annotations

import pytest


def test_the_model_identity_is_the_same_at_every_tp_size(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm")
    import json
    from types import SimpleNamespace

    from vllm.config import ParallelConfig

    from hkvd.shim.identity import engine_identity, model_identity

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))

    def cfg(tp: int, cache_dtype: str = "auto", dtype: str = "bfloat16") -> SimpleNamespace:
        model = SimpleNamespace(model=str(tmp_path), revision=None, dtype=dtype, quantization=None)
        cache = SimpleNamespace(cache_dtype=cache_dtype, mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto")
        return SimpleNamespace(model_config=model, cache_config=cache,
                               parallel_config=ParallelConfig(tensor_parallel_size=tp), attention_config=None)

    assert engine_identity(cfg(1)) != engine_identity(cfg(2))
    assert model_identity(cfg(1)) == model_identity(cfg(2)) == model_identity(cfg(4))
    # The cache dtype is compared by the daemon in each group's dtype (a refusal it logs), not here.
    assert model_identity(cfg(1, "fp8")) == model_identity(cfg(2))
    assert model_identity(cfg(1, dtype="float16")) != model_identity(cfg(2))
