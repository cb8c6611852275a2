# SPDX-License-Identifier: Apache-2.0
"""MLA caches stored once per node, in real vLLM (CPU): a TP=2 engine of a tiny DeepSeek-V2 (multi-head latent
attention: every rank's KV cache is the same latent page) stores each chunk once, not once per rank; a fresh TP=2
engine hits the whole cacheable prefix on both ranks from those entries, and a fresh TP=1 engine hits it too, read
directly (no re-sharding), with the greedy tokens of an engine of its TP size without hkvd.

The shim marks MLA groups replicated (``EngineSpec.replicated``); the daemon keys a world whose every group is
replicated by one TP-free fingerprint (docs/design.md, "Replicated groups (MLA)"). Per-rank copies would show as
twice the entries, and a TP=1 engine would miss (MLA is not re-sharded).
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

BLOCK = 16  # vLLM's CPU MLA kernel takes block 16 only (its platform forces it for MLA models)
MAX_TOKENS = 8  # e2e_run's default
# One chunk of the MLA group: 2 layers x 16 tokens x (512 latent + 64 rope) x 2 bytes (bfloat16), one rank's.
ENTRY_BYTES = 2 * BLOCK * 576 * 2


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]


P1 = _seq(601, 7, 3)  # 37 whole chunks: 592 tokens cacheable


def test_mla_tp2_stores_each_chunk_once_and_tp2_and_tp1_engines_hit_it(tiny_lib, models_root, outputs,
                                                                       daemon_factory, engine_runner) -> None:
    from hkvd.shim.testing.launcher import daemon_status

    model = tiny_lib.build("deepseek_mla", models_root)
    d = daemon_factory(BLOCK)
    base = {"model": str(model), "socket": d.socket, "max_num_batched_tokens": 128}
    tp2 = {**base, "omp_bind": "0|1", "llm": {"tensor_parallel_size": 2}}
    ref1 = engine_runner({**base, "connector": False, "prompts": [P1]}, timeout_s=600)

    stored = engine_runner({**tp2, "prompts": [P1]}, timeout_s=600)  # TP=2 stores P1 (and its answer's chunks)
    assert stored["block_size"] == BLOCK, stored["block_size"]
    assert outputs.hits(stored) == [0], stored["log"][-3000:]
    index = daemon_status(d.socket)["index"]
    # One entry per chunk: the prompt's 37 whole chunks, and the answer's where it fills one (store_decode). Per-rank
    # copies would be twice as many.
    whole, most = len(P1) // BLOCK, (len(P1) + MAX_TOKENS) // BLOCK
    assert whole <= index["entries"] <= most, index
    assert index["bytes_stored"] == index["entries"] * ENTRY_BYTES, index  # each one rank's bytes
    figure = index["bytes_stored"] / (index["entries"] * BLOCK)
    print(f"MLA TP=2: {index['entries']} entries, {figure:.0f} pool bytes per cached token "
          f"(per-rank copies: {2 * figure:.0f}; 0.5x)")

    warm = engine_runner({**tp2, "prompts": [P1]}, timeout_s=600)  # both ranks read the one copy
    cacheable = (len(P1) - 1) // BLOCK * BLOCK
    assert outputs.hits(warm) == [cacheable], warm["log"][-4000:]
    outputs.compare(stored["results"][0], warm["results"][0], "MLA TP=2 warm vs cold")

    one = engine_runner({**base, "prompts": [P1]}, timeout_s=600)  # TP=1 reads the TP=2 engine's entries as its own
    assert outputs.hits(one) == [cacheable], one["log"][-4000:]
    outputs.compare(ref1["results"][0], one["results"][0], "MLA TP=1 reading TP=2's entries")
    after = daemon_status(d.socket)["index"]
    assert after["entries"] <= most, after  # nothing stored again per rank or per TP size
    for run in (warm, one):
        assert "LEASE_EXPIRED" not in run["log"] and "expired or unknown" not in run["log"]
    log = (d.workdir / f"daemon-{d.starts}.log").read_text()
    assert "are not served to a TP=" not in log  # read directly: no re-sharding, and no refusal
