# SPDX-License-Identifier: Apache-2.0
"""The usable-prefix endpoint against real vLLM (CPU): its answer equals the hit a fresh engine then gets.

Per model (Qwen3-Next: Gated-DeltaNet states at chunk boundaries; Gemma3: sliding windows), one engine
stores prompts over three shared bases (some with a ``cache_salt``) into a daemon whose small pool evicts
part of them (Gemma3's daemon also has a disk tier). Then a fresh engine runs 50 random prompts (shared
prefixes of random lengths, random tails, salted or not) one at a time: before each, once vLLM's own
cache is reset and the previous prompt's stores are done (``pause_after_reset``), the test asks
``POST /v1/usable_prefix`` for it, and the engine's ``num_cached_tokens`` (from hkvd alone) must equal
the answer's ``usable_tokens``. Two engine starts per model.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
from pathlib import Path
from typing import Any

import pytest

from hkvd.shim.client import DaemonClient

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

BLOCK = 128
MAX_PROMPT = 900  # max_model_len 1024 in e2e_run, minus the answer
QUERIES = 50
STORES = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask(port: int, model: str, spec: dict[str, Any]) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body: dict[str, Any] = {"model": model, "token_ids": spec["ids"]}
        if spec.get("salt"):
            body["cache_salt"] = spec["salt"]
        conn.request("POST", "/v1/usable_prefix", body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        out = json.loads(resp.read())
        assert resp.status == 200, out
        return out
    finally:
        conn.close()


def _workload(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(4, 500) for _ in range(n)]  # noqa: E731 - ids 0..3 are special tokens
    bases = [tok(MAX_PROMPT) for _ in range(3)]
    stores = []
    for _ in range(STORES):
        base = rng.choice(bases)
        ids = base[:rng.randrange(BLOCK + 1, MAX_PROMPT + 1)]
        if rng.random() < 0.3:
            ids = (ids[:rng.randrange(BLOCK, len(ids) + 1)] + tok(rng.randrange(1, 200)))[:MAX_PROMPT]
        stores.append({"ids": ids, "salt": rng.choice([None, None, None, "tenant-1"])})
    queries = []
    for _ in range(QUERIES):
        if rng.random() < 0.1:
            ids = tok(rng.randrange(1, MAX_PROMPT))
        else:
            src = rng.choice(stores) if rng.random() < 0.5 else {"ids": rng.choice(bases), "salt": None}
            ids = src["ids"][:rng.randrange(1, len(src["ids"]) + 1)]
            if rng.random() < 0.5:
                ids = (ids + tok(rng.randrange(1, 300)))[:MAX_PROMPT]
        queries.append({"ids": ids, "salt": rng.choice([None, None, None, "tenant-1", "tenant-2"])})
    return stores, queries


@pytest.mark.parametrize("kind", ["qwen3_next", "gemma3"])
def test_usable_prefix_equals_the_hit_a_fresh_engine_gets(kind, tiny_models, daemon_factory, engine_runner,
                                                          tmp_path: Path) -> None:
    port = _free_port()
    # Pools the stores overflow: Qwen3-Next's chunks are ~1 MiB (12 MiB pool), Gemma3's 128 KiB (4 MiB pool,
    # and a disk tier behind it).
    args = ["--metrics-port", str(port), "--l1-size-gb", "0.01171875" if kind == "qwen3_next" else "0.00390625"]
    if kind == "gemma3":
        args += ["--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "1"]
    d = daemon_factory(BLOCK, *args)
    model = str(tiny_models[kind])
    # No turn ends: the endpoint tries every position inside a chunk, an engine only where its own recent
    # turns ended (docs/routing.md); these prompts would put dozens of them after the same chunk.
    common = {"model": model, "socket": d.socket, "max_num_batched_tokens": BLOCK, "max_tokens": 1,
              "extra": {"turn_end_states": False}}
    stores, queries = _workload(seed=7 if kind == "qwen3_next" else 8)
    engine_runner({**common, "prompts": stores}, timeout_s=900)
    with DaemonClient(d.socket, client_name="test", role="tool", timeout_s=10.0) as c:
        stored = c.status()
    assert stored["index"]["evictions"] > 0, stored["index"]  # partly evicted

    answers: dict[int, dict[str, Any]] = {}
    sync = tmp_path / "sync"
    sync.mkdir()
    fresh = engine_runner({**common, "prompts": queries, "pause_before": list(range(QUERIES)),
                           "pause_after_reset": True, "sync_dir": str(sync)},
                          on_pause=lambda i: answers.__setitem__(i, _ask(port, model, queries[i])), timeout_s=900)
    with DaemonClient(d.socket, client_name="test", role="tool", timeout_s=10.0) as c:
        after = c.status()
    hits = [r["num_cached_tokens"] for r in fresh["results"]]
    usable = [answers[i]["usable_tokens"] for i in range(QUERIES)]
    equal = sum(h == u for h, u in zip(hits, usable, strict=True))
    print(f"{kind}: {equal}/{QUERIES} answers equal the fresh engine's hits; {stored['index']['evictions']} "
          f"evictions after the stores; counters {after['counters']}; hits {hits}; pool/disk "
          f"{[(a['tiers']['pool'], a['tiers']['disk']) for a in answers.values()]}")
    notes = [ln for ln in fresh["log"].splitlines() if "hkvd" in ln and ("WARN" in ln or "ERROR" in ln)]
    assert usable == hits, ([(i, len(q["ids"]), q["salt"], answers[i], hits[i]) for i, q in enumerate(queries)
                             if usable[i] != hits[i]], notes[-20:])
    assert len(set(hits)) >= 3, hits  # hits at several lengths: the comparison is not all zeros
