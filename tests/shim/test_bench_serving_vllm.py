# SPDX-License-Identifier: Apache-2.0
"""bench serving against a real vLLM OpenAI server with hkvd: the client's contract with vLLM holds.

One run of the bench's ``hkvd`` case (a real ``hkvd serve`` and vLLM's OpenAI server on the tiny
Qwen3-Next, small KV memory) with a workload of three short conversations: the streamed token
ids, ``prompt_tokens_details.cached_tokens``, /metrics' counters and the KV geometry the bench
reads from vLLM's log are all there, and the small memory makes the second turns hit hkvd, not
vLLM's own prefix cache. The same on the tiny Gemma3 (sliding windows, no Mamba state): its
geometry, its KV memory (sized by ``BenchModel.kv_blocks``) and its server flags. Correctness
only; one server start per model (~45 s).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # bench/ is not an installed package (see tests/unit/test_bench.py)
try:
    from bench import serving
    from bench.serving_client import Workload, kv_blocks
finally:
    sys.path.remove(str(ROOT))


def test_hkvd_run_serves_later_turns_from_hkvd(tiny_models: dict[str, Path]) -> None:
    w = Workload(conversations=3, concurrency=1, turns=2, first_tokens=300, user_tokens=50, answer_tokens=8)
    model = serving.MODELS["qwen3_next"]
    blocks = kv_blocks(w, serving.BLOCK, model.mamba_groups())
    run = serving._one_run("hkvd", tiny_models["qwen3_next"], model, 512, w, blocks["small"], "off", None,
                           lambda *_: None)
    assert "error" not in run, run.get("error_detail")
    assert run["geometry"]["block"] == 128 and len(run["geometry"]["group_block_sizes"]) == 4
    assert len(run["replies"]) == 6 and all(len(r["token_ids"]) == 8 for r in run["replies"])
    assert all(r["prompt_tokens"] == w.prompt_tokens(r["turn"]) for r in run["replies"])
    first = [r for r in run["replies"] if r["turn"] == 1]
    second = [r for r in run["replies"] if r["turn"] == 2]
    assert all(r["cached_tokens"] == 0 for r in first)
    # The first turn's end (its prompt and answer but the last token, 307), inside the third block: hkvd's
    # turn-end state (vLLM's own cache stops at 256, the last whole block). A shortfall names the daemon's
    # ordering counters (late Mamba offers, copy timeouts) and the connector's, which say where a hit was lost.
    end = w.first_tokens + w.answer_tokens - 1
    assert all(r["cached_tokens"] == end for r in second), (
        [(r["conv"], r["cached_tokens"]) for r in second], run["daemon"], run["counters"])
    c = run["counters"]
    assert c["prompt_tokens"] == sum(w.prompt_tokens(t) for t in (1, 2)) * 3
    assert c["local_hits"] + c["external_hits"] == 3 * end
    assert c["external_hits"] >= end  # the small memory evicted at least the first conversation
    assert run["daemon"]["entries"] > 0 and run["daemon"]["stores_dropped"] == 0
    later = next(t for t in run["turns"] if t["turn"] == "later")
    assert later["hit_share"] == 3 * end / (3 * w.prompt_tokens(2))


def test_hkvd_run_on_gemma3_serves_later_turns_from_hkvd(tiny_models: dict[str, Path]) -> None:
    # 400 + 8 + 50 + 8 = 466 tokens: 4 blocks of full attention and 4 in each of the 3 sliding-window groups,
    # 16 a conversation, 20 for the one running: the two others do not fit beside it.
    w = Workload(conversations=3, concurrency=1, turns=2, first_tokens=400, user_tokens=50, answer_tokens=8)
    model = serving.MODELS["gemma3"]
    blocks = model.kv_blocks(w)
    assert blocks["per_conversation"] == 16 and blocks["small"] == 20
    run = serving._one_run("hkvd", tiny_models["gemma3"], model, 512, w, blocks["small"], "off", None,
                           lambda *_: None)
    assert "error" not in run, run.get("error_detail")
    assert run["geometry"]["block"] == 128 and run["geometry"]["group_block_sizes"] == [128] * 4
    assert len(run["replies"]) == 6 and all(len(r["token_ids"]) == 8 for r in run["replies"])
    second = [r for r in run["replies"] if r["turn"] == 2]
    assert all(r["cached_tokens"] == 0 for r in run["replies"] if r["turn"] == 1)
    # The first turn's whole blocks (408 tokens: 3 x 128), the window's blocks before them included.
    assert all(r["cached_tokens"] == 384 for r in second), ([(r["conv"], r["cached_tokens"]) for r in second],
                                                            run["daemon"], run["counters"])
    c = run["counters"]
    assert c["preemptions"] == 0  # the small memory holds the running conversation
    assert c["local_hits"] + c["external_hits"] == 3 * 384
    assert c["external_hits"] >= 384  # the small memory evicted at least the first conversation
    assert run["daemon"]["entries"] > 0 and run["daemon"]["stores_dropped"] == 0
