"""One vLLM engine (CPU) in its own process for ``bench.vllm_e2e``; prints one JSON line last.

    python -m bench.vllm_engine '{"model": DIR, "socket": PATH | null, "prompts": [[ids...], ...],
                                  "block": 128, "warmup_prompt": [ids...], "repeats": 1}'

``socket`` null runs vLLM without a KV connector (the reference); otherwise with
``HkvdConnector`` on that socket. Settings follow the shim's serve recipe for hybrids (prefix
caching on, ``max_num_batched_tokens`` = block size N, ``prefix_cache_retention_interval`` = N
where vLLM has it; ``mamba_cache_mode align`` for Mamba/GDN models is the shim's default path).

Per prompt: ``llm.reset_prefix_cache()`` (vLLM's own cache is emptied, hkvd's is not, so every
cached token came from hkvd), then ``generate`` with ``max_tokens=1`` timed on the wall clock:
the time to first token of a single request on an idle engine (scheduling, any hkvd lookup and
load, the prefill steps, sampling one token). ``repeats`` runs the prompt list that many times
(more samples where a repeat measures the same thing: without a connector, or warm). One
warm-up generate of a short prompt (shorter than a chunk: nothing is stored) runs first so
one-off costs do not land on the first prompt.

Output: ``HKVD_BENCH {"results": [{"prompt_tokens", "cached_tokens", "ttft_s", "token"}...],
"startup_s"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from hkvd.shim.testing.vllm_cache import reset_prefix_cache


def engine_kwargs(args: dict) -> dict:
    """``LLM``'s connector arguments for ``args["socket"]`` (none for a null socket): every hit loaded (the
    benches measure loads; sampled verification would recompute a random 1 %), and the connector's timeline
    written to ``args["timeline"]`` where given; hits loaded in the step that plans them with
    ``args["in_step_loads"]`` (docs/design.md, "In-step loads")."""
    if not args.get("socket"):
        return {}
    extra: dict = {"socket_path": args["socket"], "reconnect_interval_s": 0.5, "verify_fraction": 0.0}
    if args.get("timeline"):
        extra["timeline_path"] = args["timeline"]
    if args.get("in_step_loads"):
        extra["in_step_loads"] = True
    return {"kv_transfer_config": {"kv_connector": "HkvdConnector", "kv_connector_module_path": "hkvd.shim.connector",
                                   "kv_role": "kv_both", "kv_connector_extra_config": extra}}


def main() -> None:
    args = json.loads(sys.argv[1])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    block = int(args["block"])
    kw = engine_kwargs(args)
    if args.get("retention"):
        kw["prefix_cache_retention_interval"] = block
    llm = LLM(model=args["model"], enforce_eager=True, dtype="bfloat16", max_model_len=1024,
              enable_prefix_caching=True, max_num_batched_tokens=block, seed=0, **kw)
    startup = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    reset_prefix_cache(llm)
    llm.generate([TokensPrompt(prompt_token_ids=args["warmup_prompt"])], sp, use_tqdm=False)
    results = []
    for _ in range(int(args.get("repeats", 1))):
        for ids in args["prompts"]:
            reset_prefix_cache(llm)
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
            ttft = time.perf_counter() - t
            results.append({"prompt_tokens": len(ids), "cached_tokens": int(out.num_cached_tokens or 0),
                            "ttft_s": ttft, "token": int(out.outputs[0].token_ids[0])})
    print("HKVD_BENCH " + json.dumps({"results": results, "startup_s": startup}), flush=True)


if __name__ == "__main__":
    main()
