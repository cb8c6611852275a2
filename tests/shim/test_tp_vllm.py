# SPDX-License-Identifier: Apache-2.0
"""Tensor parallelism in real vLLM (CPU): a TP=2 engine (two worker processes) hits what a TP=2 engine
stored, on every rank, as much as a single-rank engine does, with the same greedy tokens.

Each rank registers its own shards; the scheduler's lookup answers what both ranks hold and leases
both ranks' entries under one lease, which each rank's retrieve uses once.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

BLOCK = 128
LOGPROB_TOL = 0.02


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]


P1 = _seq(601, 7, 3)
P3 = _seq(900, 13, 1)


def _hits(res: dict) -> list[int]:
    return [r["num_cached_tokens"] for r in res["results"]]


def test_gemma3_tp2_cold_warm(tiny_models, daemon_factory, engine_runner) -> None:
    d = daemon_factory(BLOCK)
    common = {"model": str(tiny_models["gemma3"]), "socket": d.socket, "max_num_batched_tokens": BLOCK,
              "omp_bind": "0|1", "llm": {"tensor_parallel_size": 2}}
    cold = engine_runner({**common, "prompts": [P1, P3]}, timeout_s=600)
    assert _hits(cold) == [0, 0], cold["log"][-3000:]
    warm = engine_runner({**common, "prompts": [P1, P3]}, timeout_s=600)
    # The same share as the single-rank run of these prompts (test_e2e_vllm.py): 512 and 896.
    assert _hits(warm) == [512, 896], warm["log"][-4000:]
    for c, w in zip(cold["results"], warm["results"], strict=True):
        assert c["tokens"] == w["tokens"]
        assert max(abs(x - y) for x, y in zip(c["logprobs"], w["logprobs"], strict=True)) <= LOGPROB_TOL
    assert "LEASE_EXPIRED" not in warm["log"] and "expired or unknown" not in warm["log"]
