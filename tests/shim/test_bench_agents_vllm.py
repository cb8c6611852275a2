# SPDX-License-Identifier: Apache-2.0
"""bench agents' pinned run against a real vLLM OpenAI server and ``hkvd serve``: what the bench reads is there.

One ``hkvd_pins`` run of the bench (``bench.agents._one_run``: a fresh daemon, vLLM's OpenAI server on
the tiny Qwen3-Next with ``--prefix-match-unit 32``, small KV memory) with four short sessions of two
turns, beside the one-shot stream: every session request carries its session's pin and no one-shot does
(vLLM counts the pins sent), the one-shots are reported apart from the sessions, the daemon reports pinned
bytes in the timeline the bench samples, and the second turns hit hkvd. Correctness only; one server start.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # bench/ is not an installed package (see tests/unit/test_bench.py)
try:
    from bench import agents
    from bench.agents_client import Agents
finally:
    sys.path.remove(str(ROOT))


def test_pinned_run_sends_pins_and_samples_the_pool(tiny_models: dict[str, Path]) -> None:
    w = Agents(sessions=4, concurrency=1, turns=2, system_tokens=128, task_tokens=130, answer_tokens=4,
               pause_mean_s=0.05, pause_max_s=0.1, tool_min=100, tool_max=150, oneshot_min=150, oneshot_max=200,
               oneshot_limit=10)
    model = agents.MODELS["qwen3_next"]  # the tiny model itself: these sessions stay under 512 tokens
    blocks = agents.kv_blocks(w, model)["small"]
    run = agents._one_run("hkvd_pins", tiny_models["qwen3_next"], 512, w, blocks, 64 << 20, "off", lambda *_: None)
    assert "error" not in run, run.get("error_detail")
    assert run["prefix_match_unit"] == {"asked": 32, "used": 32, "error": None}
    assert len(run["replies"]) == 8 and all(len(r["token_ids"]) == 4 for r in run["replies"])
    assert all(r["prompt_tokens"] == w.prompt_tokens(r["conv"], r["turn"]) for r in run["replies"])
    o = run["oneshots"]
    assert 1 <= o["count"] <= 10 and o["ttft_ms_p50"] > 0 and o["hit_share"] == 0.0  # unique prompts
    c = run["counters"]
    assert c["hkvd_pins_sent"] == 16 and c["hkvd_pins_refused"] == 0  # 8 session turns x (arrival, finish); no one-shot
    assert c["external_hits"] >= 256  # the small memory evicted at least one session's first turn
    # A second turn hits at least the first prompt's whole blocks (not every one: on the loaded shared machine
    # a run saw a second turn hit less).
    second = [r for r in run["replies"] if r["turn"] == 2]
    assert any(r["cached_tokens"] >= 256 for r in second), [(r["conv"], r["cached_tokens"]) for r in second]
    timeline = run["pool_timeline"]
    assert timeline and all(s["t_s"] >= 0 for s in timeline)
    assert max(s["pinned_bytes"] for s in timeline) > 0
    assert run["daemon"]["pins"]["sessions"] == 4 and run["daemon"]["pins"]["pinned_bytes"] > 0
    assert run["daemon"]["evictions"] == 0  # a 64 MiB pool holds these sessions and 10 one-shots
    assert run["between_turns"]["max"] >= 1
