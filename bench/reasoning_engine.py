"""One vLLM engine (CPU) that runs ``bench.reasoning``'s chats; prints one JSON line last.

    python -m bench.reasoning_engine '{"model": DIR, "socket": PATH, "store_decode": true | "auto",
                                       "block": 128, "conversations": [{"first": [ids], "users": [[ids]...],
                                       "answers": [[ids]...], "thinking": N}, ...], "open": [ids]}'

Each conversation is a reasoning model's chat: every turn's prompt ends with ``open`` (the generation prompt's
``<think>``) and the engine generates ``thinking`` tokens (greedy, EOS ignored), which stand for the thinking part;
the next turn's prompt is the previous one without ``open``, plus the turn's answer, plus the next user message,
plus ``open``: what a template that drops the thinking part renders. The conversations take turns (A1, B1, A2,
...). Before every turn vLLM's prefix cache is reset, so every cached token comes from hkvd; after it the engine
is stepped until the request's stores are done (its core runs in this process).

Output: ``HKVD_BENCH {"turns": [[{"prompt_tokens", "cached_tokens", "tokens"}, ...], ...], "startup_s",
"decode_bytes_not_stored"}`` (the last from vLLM's ``vllm:hkvd_decode_bytes_not_stored_total``, every reason).
"""

from __future__ import annotations

import json
import os
import sys
import time

from bench.vllm_engine import engine_kwargs
from hkvd.shim.testing.vllm_cache import place_engine_core, reset_prefix_cache, settle


def main() -> None:
    args = json.loads(sys.argv[1])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    place_engine_core({})  # the core in this process: settle() steps it until the stores are done
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    block = int(args["block"])
    kw = engine_kwargs(args)
    kw["kv_transfer_config"]["kv_connector_extra_config"]["store_decode"] = args["store_decode"]
    llm = LLM(model=args["model"], enforce_eager=True, dtype="bfloat16", enable_prefix_caching=True, seed=0,
              max_model_len=2048, max_num_batched_tokens=block, prefix_cache_retention_interval=block,
              disable_log_stats=False, **kw)
    startup_s = time.perf_counter() - t0
    convs, opening = args["conversations"], list(args["open"])
    bases = [list(c["first"]) for c in convs]
    turns: list[list[dict]] = [[] for _ in convs]
    for t in range(max(len(c["users"]) + 1 for c in convs)):
        for i, c in enumerate(convs):
            if t > len(c["users"]):
                continue
            if t:
                bases[i] += list(c["answers"][t - 1]) + list(c["users"][t - 1])
            prompt = bases[i] + opening
            reset_prefix_cache(llm)
            sp = SamplingParams(max_tokens=int(c["thinking"]), temperature=0.0, ignore_eos=True)
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
            settle(llm)
            turns[i].append({"prompt_tokens": len(prompt), "cached_tokens": int(out.num_cached_tokens or 0),
                             "tokens": list(out.outputs[0].token_ids)})
    print("HKVD_BENCH " + json.dumps({"turns": turns, "startup_s": startup_s,
                                      "decode_bytes_not_stored": _not_stored()}), flush=True)


def _not_stored() -> float:
    """``vllm:hkvd_decode_bytes_not_stored_total``, summed over its reasons, from this process's registry."""
    from prometheus_client import REGISTRY

    return sum(float(s.value) for fam in REGISTRY.collect() if fam.name == "vllm:hkvd_decode_bytes_not_stored"
               for s in fam.samples if s.name.endswith("_total"))


if __name__ == "__main__":
    main()
