# SPDX-License-Identifier: Apache-2.0
"""Entries across tensor-parallel sizes in real vLLM (CPU), tiny Gemma3 (sliding window + full attention, 2 KV
heads: one per rank at TP=2): a TP=2 engine stores, a fresh TP=1 engine hits the whole cacheable prefix with
the greedy tokens of a TP=1 engine without hkvd; then a TP=2 engine hits what the TP=1 engine stored, with
the greedy tokens of a TP=2 engine without hkvd. Each hit across TP sizes comes only from re-sharding on read
(daemon/engines/reshards.py): every entry of the other world is in the other TP size's format.
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


def test_qwen3_next_across_tp_sizes_is_a_miss_and_one_log_line(tiny_lib, models_root, outputs, daemon_factory,
                                                                engine_runner) -> None:
    """Gated-DeltaNet + full attention: vLLM aligns the block size to the per-rank GDN state page, so TP=1 and
    TP=2 engines of one model have other block sizes (and GDN states are not re-sharded yet): a TP=1 engine gets
    a miss, never a wrong hit, and the daemon says why once."""
    model = tiny_lib.build("qwen3_next_tp2", models_root)
    d = daemon_factory(BLOCK)
    common = {"model": str(model), "socket": d.socket, "max_num_batched_tokens": 256}
    prompts = [_seq(901, 7, 3), P1]
    stored = engine_runner({**common, "omp_bind": "0|1", "llm": {"tensor_parallel_size": 2}, "prompts": prompts},
                           timeout_s=600)
    assert outputs.hits(stored) == [0, 0], stored["log"][-3000:]
    one = engine_runner({**common, "prompts": prompts}, timeout_s=600)
    assert outputs.hits(one) == [0, 0], one["log"][-4000:]
    log = (d.workdir / f"daemon-{d.starts}.log").read_text()
    refused = [line for line in log.splitlines() if "are not served to a TP=1 engine" in line]
    assert len(refused) == 1, refused  # the reason: the block size (or the GDN states) of the two TP sizes
