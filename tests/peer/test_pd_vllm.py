# SPDX-License-Identifier: Apache-2.0
"""Prefill/decode pair in real vLLM (CPU): a prefill ``LLM`` (kv_producer) and a decode ``LLM``
(kv_consumer), each with its own ``hkvd serve``; the decode daemon pulls the prompt's KV (a
Qwen3-Next hybrid: full attention + Gated-DeltaNet states) from the prefill daemon with NIXL, and
the decode engine's greedy output equals a single engine's.

Costs three engine starts, each forked from the session's engine zygote. Needs vLLM (``make vllm``) and NIXL."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]
BLOCK = 128  # vLLM's block size for the tiny Qwen3-Next on CPU (= hkvd chunk size N)
_SESSION_ENV = dict(os.environ)  # before any test's monkeypatch: the engine zygote's imports see no test's settings
LOGPROB_TOL = 0.02  # nats: a few bf16 ulps (a restored state may differ from a recomputed one by one)


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]  # ids 0..3 are special tokens


# 4 chunks, 7 chunks, none, and 5 chunks whose params the test points at a dead peer address
PROMPTS = [_seq(601, 7, 3), _seq(900, 13, 1), _seq(100, 11, 5), _seq(700, 5, 9)]
DEAD = 3


def _vllm_missing() -> str | None:
    try:
        import vllm  # noqa: F401
    except Exception as e:
        return f"vllm is not importable ({type(e).__name__}: {e}); run `make vllm`"
    return None


def _model(tmp_path_factory: pytest.TempPathFactory, kind: str = "qwen3_next") -> Path:
    spec = importlib.util.spec_from_file_location("hkvd_tiny_models", HERE.parent / "shim" / "tiny_models.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    env_root = os.environ.get("HKVD_TEST_MODELS")  # Path("") would be the current directory
    root = Path(env_root) if env_root else tmp_path_factory.mktemp("models")
    return Path(mod.build(kind, root))


def _run(args: dict[str, Any], timeout_s: float = 400) -> dict[str, Any]:
    """One engine of pd_run.py, forked from the session's engine zygote (hkvd.shim.testing.zygote)."""
    from hkvd.shim.testing.zygote import engine_env, fork_engine

    proc = fork_engine([str(HERE / "pd_run.py"), json.dumps(args)], engine_env(os.environ), _SESSION_ENV)
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(proc.lines()), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:
        proc.kill()
    reader.join(30)
    text = b"".join(chunks).decode(errors="replace")
    for line in text.splitlines():
        if line.startswith("HKVD_PD "):
            res: dict[str, Any] = json.loads(line[len("HKVD_PD "):])
            res["log"] = text
            return res
    raise AssertionError(f"{args['role']} engine failed (rc {proc.returncode}):\n{text[-6000:]}")


def _hkvd_lines(log: str) -> str:
    return "\n".join(line for line in log.splitlines() if "hkvd" in line.lower())[-6000:]


def test_prefill_decode_pair_matches_a_single_engine(tmp_path: Path, tmp_path_factory: Any, lib: Any) -> None:
    why = _vllm_missing()
    if why:
        pytest.skip(why)
    model = str(_model(tmp_path_factory))
    prefill, decode = lib.start_pair(tmp_path, chunk_size=BLOCK, pool_gb="0.5")
    single = lib.PeerDaemon(tmp_path, "single", ["--l1-size-gb", "0.25", "--chunk-size", str(BLOCK)])
    single.env.pop("HKVD_PEER_TOKEN", None)
    single.start(60)
    try:
        common = {"model": model, "prompts": PROMPTS, "max_num_batched_tokens": BLOCK}
        prod = _run({**common, "role": "kv_producer", "socket": prefill.socket_path})
        params = [r["params"] for r in prod["results"]]
        n = [(len(p) - 1) // BLOCK for p in PROMPTS]
        for p, chunks in zip(params, n, strict=True):
            if chunks == 0:
                assert p is None or "hkvd_peer" not in p, p
                continue
            assert p["hkvd_peer"] == prefill.peer_address and p["hkvd_chunks"] == chunks, p
            assert p["do_remote_prefill"] is True and p["hkvd_chunk_size"] == BLOCK

        # A pull that cannot happen (nothing listens there) is a failed load: recomputed, same answer.
        params[DEAD] = {**params[DEAD], "hkvd_peer": f"127.0.0.1:{lib.free_port()}"}
        dec = _run({**common, "role": "kv_consumer", "socket": decode.socket_path, "params": params})
        ref = _run({**common, "role": "kv_both", "socket": single.socket_path})
        for i, (d, r) in enumerate(zip(dec["results"], ref["results"], strict=True)):
            assert d["tokens"] == r["tokens"], f"prompt {i}: decode {d['tokens']} vs single engine {r['tokens']}"
            delta = max((abs(a - b) for a, b in zip(d["logprobs"], r["logprobs"], strict=True)), default=0.0)
            assert delta <= LOGPROB_TOL, f"prompt {i}: logprob delta {delta:.5f}"
            # Every full chunk before the last token came from the prefill engine, through the pull.
            want = 0 if i == DEAD else n[i] * BLOCK
            assert d["num_cached_tokens"] == want, (i, d["num_cached_tokens"], _hkvd_lines(dec["log"]))
            assert r["num_cached_tokens"] == 0
        s = decode.status()
        c = s["counters"]
        assert c["peer_pulls"] == sum(1 for x in n if x) and s["peer"]["transport"]["reads_failed"] == 0
        assert s["peer"]["transport"]["reads"] == sum(1 for x in n if x) - 1  # none for the dead peer
        # What the engine loaded is exactly what its daemon pulled (4 + 7 chunks of full attention,
        # and 3 Gated-DeltaNet states per prompt), nothing was recomputed from a failed load.
        assert c["peer_pulled_entries"] == 4 + 7 + 3 * 2
        assert c["retrieved_bytes"] == c["peer_pulled_bytes"] > 0
        assert dec["log"].count("not loaded") == 1 and "cannot reach the peer hkvd" in dec["log"]
        p = prefill.status()
        assert p["index"]["leases"] == 0  # the producer's hold leases went with the pulls
    finally:
        single.stop()
        for d in (prefill, decode):
            d.stop()


def test_tensor_parallel_pairs_of_the_same_and_of_another_tp_size(tmp_path: Path, tmp_path_factory: Any,
                                                                   lib: Any) -> None:
    """TP=2 prefill to TP=2 decode (Gemma3: two worker processes on each side): each decode rank's daemon
    pull fetches that rank's shards, and the output equals a TP=2 single engine's. Then a TP=1 decode engine
    with a daemon of its own pulls across TP sizes: its daemon learns the TP=2 world from the prefill daemon,
    pulls both prefill ranks' entries (each holds one of Gemma3's 2 KV heads) and its load re-shards them; the
    output equals a TP=1 single engine's, and every loaded byte is one the pull moved."""
    why = _vllm_missing()
    if why:
        pytest.skip(why)
    model = str(_model(tmp_path_factory, "gemma3"))
    prefill, decode = lib.start_pair(tmp_path, chunk_size=BLOCK, pool_gb="0.5")
    args = ["--l1-size-gb", "0.25", "--chunk-size", str(BLOCK)]
    decode1 = lib.PeerDaemon(tmp_path, "decode1", [*args, "--peer-token-file", str(tmp_path / "decode.token")])
    single = lib.PeerDaemon(tmp_path, "single", args)
    single1 = lib.PeerDaemon(tmp_path, "single1", args)  # a fresh daemon: the TP=1 reference computes it all
    for d in (single, single1):
        d.env.pop("HKVD_PEER_TOKEN", None)
    for d in (decode1, single, single1):
        d.start(60)
    prompts = PROMPTS[:2]
    n = [(len(p) - 1) // BLOCK for p in prompts]
    one = {"model": model, "prompts": prompts, "max_num_batched_tokens": BLOCK}
    tp2 = {**one, "omp_bind": "0|1", "llm": {"tensor_parallel_size": 2}}

    def check(dec: dict[str, Any], ref: dict[str, Any]) -> None:
        for i, (d, r) in enumerate(zip(dec["results"], ref["results"], strict=True)):
            assert d["tokens"] == r["tokens"], f"prompt {i}: decode {d['tokens']} vs single engine {r['tokens']}"
            delta = max((abs(a - b) for a, b in zip(d["logprobs"], r["logprobs"], strict=True)), default=0.0)
            assert delta <= LOGPROB_TOL, f"prompt {i}: logprob delta {delta:.5f}"
            assert d["num_cached_tokens"] == n[i] * BLOCK, (i, d["num_cached_tokens"], _hkvd_lines(dec["log"]))
            assert r["num_cached_tokens"] == 0

    try:
        prod = _run({**tp2, "role": "kv_producer", "socket": prefill.socket_path}, timeout_s=600)
        params = [r["params"] for r in prod["results"]]
        assert [p["hkvd_chunks"] for p in params] == n, params
        dec = _run({**tp2, "role": "kv_consumer", "socket": decode.socket_path, "params": params}, timeout_s=600)
        ref = _run({**tp2, "role": "kv_both", "socket": single.socket_path}, timeout_s=600)
        check(dec, ref)
        c = decode.status()["counters"]
        assert c["peer_pulls"] == 2 * len(prompts)  # one pull per rank per request
        assert c["retrieved_bytes"] == c["peer_pulled_bytes"] > 0

        # Another TP size: a TP=1 decode engine reads both prefill ranks' entries, re-sharded.
        dec1 = _run({**one, "role": "kv_consumer", "socket": decode1.socket_path, "params": params})
        ref1 = _run({**one, "role": "kv_both", "socket": single1.socket_path})
        check(dec1, ref1)
        s = decode1.status()
        c = s["counters"]
        assert c["peer_pulls"] == len(prompts) and s["peer"]["transport"]["reads_failed"] == 0
        assert c["retrieved_bytes"] == c["peer_pulled_bytes"] > 0  # the TP=1 rank loads every head pulled
        assert "are not pulled for a TP=" not in decode1.log(), decode1.log()[-3000:]
    finally:
        for d in (single, single1, decode1, prefill, decode):
            d.stop()
