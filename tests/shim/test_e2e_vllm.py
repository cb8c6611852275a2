# SPDX-License-Identifier: Apache-2.0
"""End to end inside real vLLM (CPU): a real ``hkvd serve`` and ``LLM(...)`` engines.

Each engine runs in its own process (tests/shim/e2e_run.py), so a warm run starts with an
empty vLLM prefix cache, and the script resets vLLM's local cache before every prompt:
``num_cached_tokens > 0`` can only come from hkvd.

What is compared (tests/shim/outputs.py): greedy tokens strictly; logprobs within ``LOGPROB_TOL``.
Runs use the same ``VLLM_CPU_OMP_THREADS_BIND`` and ``max_num_batched_tokens`` (one block per
step).

Engines run their engine core in the test's process (tests/shim/e2e_run.py, "Processes"); the start-up
error test keeps vLLM's own process topology.

Steps a hit costs (docs/design.md): the cold Qwen3-Next run (GDN + full attention, align mode: two misses,
two hits) and the warm Gemma3 run (sliding window + full attention: two hits) write the connector's timeline,
and every request's scheduler steps from its first scheduling to its first forward are checked against the
docs (tests/shim/step_counts.py). Their lookup wait covers the daemon's reply, so only the load's steps count.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 128  # vLLM's block size for both tiny models on CPU (aligned to the GDN state page)


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]  # ids 0..3 are special tokens


BASE, ALT, OTHER = _seq(900, 7, 3), _seq(900, 13, 1), _seq(200, 11, 5)
P1 = BASE[:601]  # 4 full chunks + tail
P2 = BASE[:400] + OTHER[:150]  # shares 3 chunks with P1
P3 = ALT[:900]  # long: 7 full chunks; intermediate Mamba boundaries need retention
P4 = ALT[:300] + OTHER[:100]  # shares 2 chunks with P3: needs P3's state at 256


def _timed(path: Path) -> dict[str, object]:
    """Extra config: the connector's timeline to ``path``, and a lookup wait long enough for any reply."""
    return {"timeline_path": str(path), "lookup_wait_s": 5.0, "lookup_wait_max_s": 5.0}


def test_qwen3_next_cold_warm_restart(tiny_models, outputs, daemon_factory, engine_runner, step_counts,
                                      tmp_path: Path) -> None:
    d = daemon_factory(chunk_size=BLOCK)
    common = {"model": str(tiny_models["qwen3_next"]), "socket": d.socket, "max_num_batched_tokens": BLOCK,
              "retention": BLOCK}
    prompts = [P1, P2, P3, P4]

    cold = engine_runner({**common, "prompts": prompts, "extra": _timed(tmp_path / "cold.jsonl")})
    # P2 already hits P1's chunks [0, 3) in the cold engine; P4 hits P3's intermediate state at
    # 256 tokens, which exists only because retention offered the boundary.
    assert outputs.hits(cold) == [0, 384, 0, 256], cold["log"][-3000:]
    steps = step_counts.check(str(tmp_path / "cold.jsonl"), cold["async_scheduling"])
    assert len(steps["hits"]) == 2 and steps["misses"] == [0, 0], steps
    print("qwen3_next steps to the first forward:", steps)

    warm = engine_runner({**common, "prompts": prompts})
    assert outputs.hits(warm) == [512, 512, 896, 384], warm["log"][-3000:]

    # Fresh daemon (empty): no hits, recomputed. Mid-run restart: the live engine reconnects,
    # registers again, recomputes the prompt after the restart and hits on the next one.
    d.restart()
    # vLLM's own process topology: its engine core steps by itself between two prompts, so the connector sees
    # the restarted daemon and reconnects before the next prompt, which is then stored. With the core in the
    # engine script's process nothing steps it there, and the next prompt's lookup is the first to notice.
    restarted = engine_runner(
        {**common, "prompts": [P1, P1, P1, P1, P3], "pause_before": [2], "sync_dir": str(tmp_path),
         "processes": True},
        on_pause=lambda i: d.restart(),
    )
    assert outputs.hits(restarted) == [0, 512, 0, 512, 0], restarted["log"][-3000:]
    assert restarted["log"].count("unavailable") <= 2, "one warning per side per outage, not a storm"

    deltas = {}
    for i, name in enumerate(["P1", "P2", "P3", "P4"]):
        deltas[f"warm {name}"] = outputs.compare(cold["results"][i], warm["results"][i], f"warm {name}")
    baseline_p1 = restarted["results"][0]  # computed with nothing cached
    for i in range(4):
        deltas[f"restart run {i}"] = outputs.compare(baseline_p1, restarted["results"][i], f"P1 run {i}")
    deltas["cold vs recomputed P1"] = outputs.compare(baseline_p1, cold["results"][0], "cold P1")
    deltas["cold vs recomputed P3"] = outputs.compare(restarted["results"][4], cold["results"][2], "P3")
    print("logprob deltas:", {k: round(v, 5) for k, v in deltas.items()})


def test_gemma3_sliding_window_cold_warm(tiny_models, outputs, daemon_factory, engine_runner, step_counts,
                                         tmp_path: Path) -> None:
    d = daemon_factory(chunk_size=BLOCK)
    common = {"model": str(tiny_models["gemma3"]), "socket": d.socket, "max_num_batched_tokens": BLOCK}
    prompts = [P1, P3]
    cold = engine_runner({**common, "prompts": prompts, "vllm_metrics": True})
    assert outputs.hits(cold) == [0, 0], cold["log"][-3000:]
    warm = engine_runner({**common, "prompts": prompts, "vllm_metrics": True, "extra": _timed(tmp_path / "w.jsonl")})
    # Window 192 < the hit: the sliding-window group is served from the chunks in its window.
    assert outputs.hits(warm) == [512, 896], warm["log"][-3000:]
    steps = step_counts.check(str(tmp_path / "w.jsonl"), warm["async_scheduling"])
    assert len(steps["hits"]) == 2, steps  # both prompts load from hkvd
    print("gemma3 steps to the first forward:", steps)
    # vLLM's own metrics show what hkvd served (the connector's get_kv_connector_stats): the cold run stored and
    # loaded nothing, the warm run loaded both prompts' hits.
    cm, wm = cold["vllm_metrics"], warm["vllm_metrics"]
    assert cm["vllm:hkvd_stored_bytes"] > 0 and cm["vllm:hkvd_loads{ok}"] == 0, cm
    assert wm["vllm:hkvd_loads{ok}"] == 2 and wm["vllm:hkvd_loads{failed}"] == 0, wm
    assert wm["vllm:hkvd_loaded_bytes"] > 0 and wm["vllm:hkvd_load_seconds"] > 0, wm
    deltas = [outputs.compare(c, w, f"gemma3 prompt {i}") for i, (c, w) in
              enumerate(zip(cold["results"], warm["results"], strict=True))]
    print("gemma3 logprob deltas:", [round(x, 5) for x in deltas])


def test_startup_error_surfaces_in_vllm_with_its_fix(tiny_models, daemon_factory, engine_runner) -> None:
    d = daemon_factory(chunk_size=BLOCK)
    # vLLM's own process topology: the error crosses the engine core's process boundary to the caller.
    res = engine_runner({"model": str(tiny_models["qwen3_next"]), "socket": d.socket, "processes": True,
                         "max_num_batched_tokens": BLOCK, "prompts": [P1], "extra": {"chunk_size": 192}},
                        expect_failure=True)
    assert "Engine core initialization failed" in res["log"]
    assert "chunk_size 192 is not a multiple of vLLM's block size N=128" in res["log"]
    assert "set kv_connector_extra_config chunk_size (and hkvd serve --chunk-size) to 128" in res["log"]
