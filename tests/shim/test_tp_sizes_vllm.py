# SPDX-License-Identifier: Apache-2.0
"""Entries across tensor-parallel sizes in real vLLM (CPU): a TP=2 engine stores, a fresh TP=1 engine hits the whole
cacheable prefix with the greedy tokens of a TP=1 engine without hkvd; then a TP=2 engine hits what the TP=1 engine
stored, with the greedy tokens of a TP=2 engine without hkvd. Tiny Gemma3 (sliding window + full attention, 2 KV
heads: one per rank at TP=2), and tiny Qwen3-Next (``qwen3_next_tp2``: 3 Gated-DeltaNet layers whose conv and SSM
states split over the ranks, 1 full-attention layer of 4 KV heads; vLLM picks block 256 at both TP sizes). Each
hit across TP sizes comes only from re-sharding on read (daemon/engines/reshards.py): every entry of the other
world is in the other TP size's format.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCK = 128


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]


P1 = _seq(601, 7, 3)  # 4 whole chunks: 512 tokens cacheable
P3 = _seq(900, 13, 1)  # 7 whole chunks: 896


def test_gemma3_tp2_to_tp1_and_tp1_to_tp2(tiny_models, outputs, daemon_factory, engine_runner) -> None:
    d = daemon_factory(BLOCK)
    base = {"model": str(tiny_models["gemma3"]), "max_num_batched_tokens": BLOCK}
    tp2 = {**base, "omp_bind": "0|1", "llm": {"tensor_parallel_size": 2}}
    ref1 = engine_runner({**base, "socket": d.socket, "connector": False, "prompts": [P1, P3]}, timeout_s=600)
    ref2 = engine_runner({**tp2, "socket": d.socket, "connector": False, "prompts": [P1, P3]}, timeout_s=600)

    stored = engine_runner({**tp2, "socket": d.socket, "prompts": [P1]}, timeout_s=600)  # TP=2 stores P1
    assert outputs.hits(stored) == [0], stored["log"][-3000:]
    outputs.compare(ref2["results"][0], stored["results"][0], "TP=2 cold P1")

    # TP=1: P1 from the TP=2 entries, re-sharded; P3 is new (stored at TP=1).
    one = engine_runner({**base, "socket": d.socket, "prompts": [P1, P3]}, timeout_s=600)
    assert outputs.hits(one) == [512, 0], one["log"][-4000:]
    outputs.compare(ref1["results"][0], one["results"][0], "TP=1 reading TP=2's P1")
    outputs.compare(ref1["results"][1], one["results"][1], "TP=1 cold P3")

    # TP=2 again: P3 from the TP=1 entries, re-sharded; P1 from its own world's.
    two = engine_runner({**tp2, "socket": d.socket, "prompts": [P3, P1]}, timeout_s=600)
    assert outputs.hits(two) == [896, 512], two["log"][-4000:]
    outputs.compare(ref2["results"][1], two["results"][0], "TP=2 reading TP=1's P3")
    outputs.compare(ref2["results"][0], two["results"][1], "TP=2 warm P1")
    for run in (one, two):
        assert "LEASE_EXPIRED" not in run["log"] and "expired or unknown" not in run["log"]
    assert "are not served to a TP=" not in (d.workdir / f"daemon-{d.starts}.log").read_text()  # no refusal


def test_qwen3_next_gdn_states_tp2_to_tp1_and_tp1_to_tp2(tiny_lib, models_root, outputs, daemon_factory,
                                                          engine_runner) -> None:
    """Gated-DeltaNet + full attention: the GDN states (conv: q, k, v channels; SSM: value heads) and the KV heads
    are read across TP sizes, so a hit is the whole cacheable prefix at the other TP size too."""
    model = tiny_lib.build("qwen3_next_tp2", models_root)
    block = 256  # vLLM's block size for this model at TP=1 and TP=2 alike (checked below)
    d = daemon_factory(block)
    base = {"model": str(model), "max_num_batched_tokens": block}
    tp2 = {**base, "omp_bind": "0|1", "llm": {"tensor_parallel_size": 2}}
    ref1 = engine_runner({**base, "socket": d.socket, "connector": False, "prompts": [P1, P3]}, timeout_s=600)
    ref2 = engine_runner({**tp2, "socket": d.socket, "connector": False, "prompts": [P1, P3]}, timeout_s=600)
    assert ref1["block_size"] == ref2["block_size"] == block, (ref1["block_size"], ref2["block_size"])

    stored = engine_runner({**tp2, "socket": d.socket, "prompts": [P1]}, timeout_s=600)  # TP=2 stores P1
    assert outputs.hits(stored) == [0], stored["log"][-3000:]
    outputs.compare(ref2["results"][0], stored["results"][0], "Qwen3-Next TP=2 cold P1")

    # TP=1: P1 from the TP=2 entries and states, re-sharded (512 of 601 tokens); P3 is new (stored at TP=1).
    one = engine_runner({**base, "socket": d.socket, "prompts": [P1, P3]}, timeout_s=600)
    assert outputs.hits(one) == [512, 0], one["log"][-4000:]
    outputs.compare(ref1["results"][0], one["results"][0], "Qwen3-Next TP=1 reading TP=2's P1")
    outputs.compare(ref1["results"][1], one["results"][1], "Qwen3-Next TP=1 cold P3")

    # TP=2 again: P3 from the TP=1 entries, re-sharded (768 of 900 tokens); P1 from its own world's.
    two = engine_runner({**tp2, "socket": d.socket, "prompts": [P3, P1]}, timeout_s=600)
    assert outputs.hits(two) == [768, 512], two["log"][-4000:]
    outputs.compare(ref2["results"][1], two["results"][0], "Qwen3-Next TP=2 reading TP=1's P3")
    outputs.compare(ref2["results"][0], two["results"][1], "Qwen3-Next TP=2 warm P1")
    for run in (one, two):
        assert "LEASE_EXPIRED" not in run["log"] and "expired or unknown" not in run["log"]
    assert "are not served to a TP=" not in (d.workdir / f"daemon-{d.starts}.log").read_text()  # no refusal
