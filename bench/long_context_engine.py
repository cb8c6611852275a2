"""One vLLM engine (CPU) that ``bench.long_context`` drives request by request over stdin.

    python -m bench.long_context_engine '{"model": DIR, "socket": PATH | null, "block": 128,
                                          "max_model_len": 33024, "max_num_batched_tokens": 8192,
                                          "retention": true, "warmup_prompt": [ids...],
                                          "timeline": PATH | null}'

``socket`` null runs vLLM without a KV connector; otherwise with ``HkvdConnector`` on that socket (sampled
verification off: every hit is loaded). Once started (and one short warm-up prompt run), the engine prints
``HKVD_BENCH_READY {"startup_s": ...}``; then each stdin line ``{"ids": [...], "reset": bool}`` runs one
request with ``max_tokens=1`` (``reset``: ``llm.reset_prefix_cache()`` first, so vLLM's own cache holds
nothing) and prints ``HKVD_BENCH_R {"ttft_s", "cached_tokens", "token"}``: the wall-clock time of
``generate``, which on an idle engine is the request's time to first token. An empty line or EOF ends it.

``timeline`` (with ``socket``): the connector writes its per-request timeline there (``timeline_path``,
docs/design.md "Timeline"); each answer then also carries ``"events": [[event, ms, step], ...]``, the first
occurrence of each event of its request, in ms since ``generate`` was called (requests run one at a time,
so the request that arrived during the call is the one asked for).
"""

from __future__ import annotations

import json
import os
import sys
import time

from bench.vllm_engine import engine_kwargs
from hkvd.shim.testing.vllm_cache import reset_prefix_cache


def main() -> None:
    args = json.loads(sys.argv[1])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The tiny models declare 2,048 positions; their random weights read longer prompts as well as short ones.
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = engine_kwargs(args)
    if args.get("retention"):
        kw["prefix_cache_retention_interval"] = int(args["block"])
    llm = LLM(model=args["model"], enforce_eager=True, dtype="bfloat16", max_model_len=int(args["max_model_len"]),
              enable_prefix_caching=True, max_num_batched_tokens=int(args["max_num_batched_tokens"]), seed=0, **kw)
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    reset_prefix_cache(llm)
    llm.generate([TokensPrompt(prompt_token_ids=args["warmup_prompt"])], sp, use_tqdm=False)
    offset = 0
    if args.get("timeline"):
        from hkvd.shim import timeline

        offset = timeline.read(args["timeline"])[1]  # the warm-up's events
    print("HKVD_BENCH_READY " + json.dumps({"startup_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        req = json.loads(line)
        if req.get("reset"):
            reset_prefix_cache(llm)
        began = time.monotonic()  # the timeline's clock
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=req["ids"])], sp, use_tqdm=False)[0]
        ttft = time.perf_counter() - t
        answer = {"ttft_s": ttft, "cached_tokens": int(out.num_cached_tokens or 0),
                  "token": int(out.outputs[0].token_ids[0])}
        if args.get("timeline"):
            answer["events"], offset = _events(args["timeline"], offset, began)
        print("HKVD_BENCH_R " + json.dumps(answer), flush=True)


def _events(path: str, offset: int, began: float) -> tuple[list[list[object]], int]:
    """The first occurrence of each event of the request that arrived since ``offset``, as [event, ms since
    ``began``, step] by time, and the offset to read on from."""
    from hkvd.shim import timeline

    by_req, offset = timeline.read(path, offset)
    arrived = [evs for evs in by_req.values() if any(e["event"] == "arrival" for e in evs)]
    if not arrived:
        return [], offset
    first = timeline.firsts(arrived[-1])
    rows = sorted(first.values(), key=lambda e: float(e["t"]))
    return [[e["event"], (float(e["t"]) - began) * 1e3, int(e["step"])] for e in rows], offset


if __name__ == "__main__":
    main()
