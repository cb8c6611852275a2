# SPDX-License-Identifier: Apache-2.0
"""One vLLM engine of a prefill/decode pair (or the single-engine reference), in its own process.

    python tests/peer/pd_run.py '{"model": DIR, "socket": PATH, "role": "kv_producer", "prompts": [...]}'

- ``kv_producer``: every prompt with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode":
  true}``; reports the ``kv_transfer_params`` vLLM returns (the shim's params for the decode side).
- ``kv_consumer``: every prompt with ``max_tokens`` and the producer's params of the same index.
- ``kv_both``: the reference, every prompt computed here.
vLLM's local prefix cache is reset before each prompt, so cached tokens can only come from hkvd.
Output: one line ``HKVD_PD {"results": [{"tokens", "logprobs", "num_cached_tokens", "params"}]}``.
"""

from __future__ import annotations

import json
import os
import sys

from hkvd.shim.testing.vllm_cache import place_engine_core, reset_prefix_cache, settle


def main() -> None:
    args = json.loads(sys.argv[1])
    if args.get("omp_bind"):  # per-rank CPU binding for tensor-parallel runs ("0|1")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args["omp_bind"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    place_engine_core(args)  # the engine core in this process unless tensor-parallel or asked otherwise
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    role = args["role"]
    llm = LLM(
        model=args["model"], enforce_eager=True, dtype="bfloat16", max_model_len=1024,
        enable_prefix_caching=True, max_num_batched_tokens=args.get("max_num_batched_tokens", 128), seed=0,
        **args.get("llm", {}),
        kv_transfer_config={
            "kv_connector": "HkvdConnector", "kv_connector_module_path": "hkvd.shim.connector", "kv_role": role,
            "kv_connector_extra_config": {"socket_path": args["socket"], "verify_fraction": 0.0,  # hits counted
                                          **args.get("extra", {})},
        },
    )
    results = []
    for i, ids in enumerate(args["prompts"]):
        reset_prefix_cache(llm)
        if role == "kv_producer":
            params: dict | None = {"do_remote_decode": True}
            max_tokens = 1
        else:
            params = args["params"][i] if role == "kv_consumer" else None
            if params:
                # vLLM reports a P/D request's cached tokens as the prefill side's own hits (here 0)
                # when this key is present; without it, num_cached_tokens is what this engine loaded.
                params = {k: v for k, v in params.items() if k != "remote_prefill_cached_tokens"}
            max_tokens = args.get("max_tokens", 8)
        extra = {"kv_transfer_params": params} if params else None
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, extra_args=extra)
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sp, use_tqdm=False)[0]
        settle(llm)  # the engine core in this process steps only when asked (e2e_run's "Processes")
        comp = out.outputs[0]
        lps = [float(d[t].logprob) for t, d in zip(comp.token_ids, comp.logprobs or [], strict=False)]
        results.append({"tokens": list(comp.token_ids), "logprobs": lps,
                        "num_cached_tokens": int(out.num_cached_tokens or 0),
                        "params": out.kv_transfer_params})
    print("HKVD_PD " + json.dumps({"results": results}), flush=True)


if __name__ == "__main__":
    main()
