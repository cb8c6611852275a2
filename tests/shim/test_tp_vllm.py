# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism in real vLLM (CPU): a TP=2 engine (two worker processes) hits what a TP=2 engine
stored, on every rank, as much as a single-rank engine does, with the same greedy tokens (Gemma3, and
a tiny Qwen3-Next whose attention and linear-attention heads both split over the ranks).

Each rank registers its own shards; the scheduler's lookup answers what both ranks hold and leases
both ranks' entries under one lease, which each rank's retrieve uses once.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

BLOCK = 128


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]


P1 = _seq(601, 7, 3)
P3 = _seq(900, 13, 1)



def test_gemma3_tp2_cold_warm(tiny_models, outputs, daemon_factory, engine_runner) -> None:
    d = daemon_factory(BLOCK)
    common = {"model": str(tiny_models["gemma3"]), "socket": d.socket, "max_num_batched_tokens": BLOCK,
              "omp_bind": "0|1", "llm": {"tensor_parallel_size": 2}}
    cold = engine_runner({**common, "prompts": [P1, P3]}, timeout_s=600)
    assert outputs.hits(cold) == [0, 0], cold["log"][-3000:]
    warm = engine_runner({**common, "prompts": [P1, P3]}, timeout_s=600)
    # The same share as the single-rank run of these prompts (test_e2e_vllm.py): 512 and 896.
    assert outputs.hits(warm) == [512, 896], warm["log"][-4000:]
    for i, (c, w) in enumerate(zip(cold["results"], warm["results"], strict=True)):
        outputs.compare(c, w, f"TP=2 prompt {i}, cold vs warm")
    assert "LEASE_EXPIRED" not in warm["log"] and "expired or unknown" not in warm["log"]


def test_qwen3_next_tp2_cold_warm(tiny_lib, models_root, outputs, daemon_factory, engine_runner) -> None:
    """Gated-DeltaNet + full attention with both kinds of heads split over two ranks: each rank stores
    and loads its own attention shards and recurrent-state pages."""
    model = tiny_lib.build("qwen3_next_tp2", models_root)
    d = daemon_factory(BLOCK)
    common = {"model": str(model), "socket": d.socket, "max_num_batched_tokens": 256, "omp_bind": "0|1",
              "llm": {"tensor_parallel_size": 2}}
    prompts = [_seq(901, 7, 3), P1]
    cold = engine_runner({**common, "prompts": prompts}, timeout_s=600)
    assert outputs.hits(cold) == [0, 0], cold["log"][-3000:]
    # vLLM aligns the block size N to the per-rank GDN state page (256 tokens here); the shim's chunk is N.
    n = cold["block_size"]  # from vLLM's config: its log line is not a contract
    warm = engine_runner({**common, "prompts": prompts}, timeout_s=600)
    # Each prompt's last boundary before its final token (vLLM's default retention offers that state).
    assert outputs.hits(warm) == [(len(p) - 1) // n * n for p in prompts], warm["log"][-4000:]
    assert all(h > 0 for h in outputs.hits(warm))
    for i, (c, w) in enumerate(zip(cold["results"], warm["results"], strict=True)):
        outputs.compare(c, w, f"Qwen3-Next TP=2 prompt {i}, cold vs warm")
