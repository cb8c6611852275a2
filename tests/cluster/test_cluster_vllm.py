# SPDX-License-Identifier: Apache-2.0
"""The cluster tier in real vLLM (CPU): a cold run on node 1, a warm run in a fresh engine on node 2.

A tiny Qwen3-Next (full attention + Gated-DeltaNet states) runs the prompts on node 1 (its daemon puts the
entries in the cluster); then another host on the cluster's network replaces one chunk's values (every group)
with real KV of another chunk, well-formed and sealed with a key the fleet does not hold. A fresh engine on
node 2, whose daemon's pool never saw the prompts, runs them again and loads them through the cluster. Its
greedy tokens equal the cold run's; the forged values are misses (``corrupt{mac}``), so the prompt they belong
to loads fewer tokens than a warm run on a single node (a fresh engine on node 1 again), and the other prompt
as many. Costs three engine starts, forked from the session's engine zygote; needs vLLM (``make vllm``),
Mooncake and root (the namespaces)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

_spec = importlib.util.spec_from_file_location("hkvd_test_pd_vllm",
                                               Path(__file__).resolve().parents[1] / "peer" / "test_pd_vllm.py")
assert _spec is not None and _spec.loader is not None
pd = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pd)  # its tiny-model builder and engine runner (tests/peer/pd_run.py)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
ARGS = ("--chunk-size", str(pd.BLOCK), "--l1-size-gb", "0.5", "--cluster-segment-gb", "0.5")
PROMPTS = pd.PROMPTS[:3]  # 4, 7 and 0 full chunks before the last token


def test_cold_on_node1_warm_on_node2(cluster: Any, lib: Any, tmp_path_factory: Any) -> None:
    why = pd._vllm_missing()
    if why:
        pytest.skip(why)
    model = str(pd._model(tmp_path_factory))
    n1 = cluster.node("node1", "p", *ARGS)
    n2 = cluster.node("node2", "d", *ARGS)
    common = {"model": model, "prompts": PROMPTS, "max_num_batched_tokens": pd.BLOCK, "role": "kv_both"}
    cold = pd._run({**common, "socket": n1.socket_path})
    s1 = n1.wait_status(lambda s: s["cluster"]["queued"] == 0 and s["index"]["pending"] == 0, 60)
    assert s1["cluster"]["puts"] > 0 and s1["cluster"]["errors"] == {}, s1["cluster"]
    assert cluster.forge_chunk() >= 2  # the attention entry and the Gated-DeltaNet states of one chunk
    warm = pd._run({**common, "socket": n2.socket_path})
    single = pd._run({**common, "socket": n1.socket_path})  # a fresh engine, warm on one node
    n = [(len(p) - 1) // pd.BLOCK for p in PROMPTS]
    short = []
    for i, (c, w, s) in enumerate(zip(cold["results"], warm["results"], single["results"], strict=True)):
        assert w["tokens"] == c["tokens"] == s["tokens"], (i, w["tokens"], c["tokens"], s["tokens"])
        assert c["num_cached_tokens"] == 0
        assert w["num_cached_tokens"] <= s["num_cached_tokens"], (i, w["num_cached_tokens"], s["num_cached_tokens"],
                                                                  pd._hkvd_lines(warm["log"]))
        assert s["num_cached_tokens"] >= (n[i] - 1) * pd.BLOCK if n[i] else s["num_cached_tokens"] == 0
        if w["num_cached_tokens"] < s["num_cached_tokens"]:
            short.append(i)
    # The forged chunk belongs to one prompt: it loads less; the other prompt's values still hit in full.
    assert len(short) == 1 and n[short[0]] > 0, short
    assert any(w["num_cached_tokens"] == s["num_cached_tokens"] > 0
               for w, s in zip(warm["results"], single["results"], strict=True))
    share = sum(w["num_cached_tokens"] for w in warm["results"]) / sum(len(p) for p in PROMPTS)
    print(f"\ncluster warm run on node 2: {share:.1%} of prompt tokens loaded (single node: "
          f"{sum(s['num_cached_tokens'] for s in single['results']) / sum(len(p) for p in PROMPTS):.1%})")
    s2 = n2.status()
    assert s2["cluster"]["gets"] > 0 and set(s2["cluster"]["corrupt"]) == {"mac"}, s2["cluster"]
    assert s2["by_kind"]["cluster_hits"].get("mamba", 0) > 0  # the Gated-DeltaNet states came through too
