# SPDX-License-Identifier: Apache-2.0
"""Real vLLM (CPU) with ``VLLM_KV_CACHE_LAYOUT`` set: the worker registers what vLLM allocates under it.

vLLM 0.32's CPU attention backend declares one layout, LBHNC (``HND`` is its legacy alias), and vLLM
refuses any other at start-up, before a connector exists. So the cold/warm run here sets
``VLLM_KV_CACHE_LAYOUT=HND`` and must give the hits and tokens the unset run gives in
test_e2e_vllm.py (Qwen3-Next-like GDN hybrid: padded Mamba pages aliased with attention pages), and
``LBNHC`` must be refused by vLLM itself. Costs three engine starts (~2 min on 2 cores).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

BLOCK = 128


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]  # ids 0..3 are special tokens


BASE, ALT, OTHER = _seq(900, 7, 3), _seq(900, 13, 1), _seq(200, 11, 5)
PROMPTS = [BASE[:601], BASE[:400] + OTHER[:150], ALT[:900], ALT[:300] + OTHER[:100]]  # as test_e2e_vllm.py


def test_cpu_layout_set_explicitly_cold_warm(tiny_models, outputs, daemon_factory, engine_runner,  # type: ignore[no-untyped-def]
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
    d = daemon_factory(chunk_size=BLOCK)
    common = {"model": str(tiny_models["qwen3_next"]), "socket": d.socket, "max_num_batched_tokens": BLOCK,
              "retention": BLOCK, "prompts": PROMPTS}
    cold = engine_runner(common)
    assert outputs.hits(cold) == [0, 384, 0, 256], cold["log"][-3000:]
    warm = engine_runner(common)
    assert outputs.hits(warm) == [512, 512, 896, 384], warm["log"][-3000:]
    for i, (c, w) in enumerate(zip(cold["results"], warm["results"], strict=True)):
        outputs.compare(c, w, f"qwen3_next HND prompt {i}")


def test_cpu_backend_refuses_other_layouts_itself(tiny_models, daemon_factory, engine_runner,  # type: ignore[no-untyped-def]
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "LBNHC")
    d = daemon_factory(chunk_size=BLOCK)
    failed = engine_runner({"model": str(tiny_models["qwen3_next"]), "socket": d.socket,
                            "max_num_batched_tokens": BLOCK, "prompts": PROMPTS[:1]},
                           expect_failure=True)
    assert "LBNHC" in failed["log"], failed["log"][-3000:]
