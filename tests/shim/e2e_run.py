# SPDX-License-Identifier: Apache-2.0
"""One vLLM engine run with the hkvd connector, in its own process; prints one JSON line.

Run by tests/shim/test_e2e_vllm.py (one process per engine, so every warm run starts with
an empty vLLM prefix cache):

    python tests/shim/e2e_run.py '{"model": DIR, "socket": PATH, "prompts": [[ids...], ...], ...}'

Before every prompt the script resets vLLM's prefix cache (``reset_prefix_cache``, which drives
steps until vLLM accepts the reset): vLLM's local cache is
emptied, the connector's is not, so ``num_cached_tokens > 0`` can only come from hkvd.
Output: ``HKVD_RESULT {"results": [{"tokens", "logprobs", "num_cached_tokens"}...], "block_size": N,
"async_scheduling": bool, "pid": N}`` (whether vLLM schedules a step before it reads the previous one's output;
the engine's process id, which the daemon's log names for its connections).

Conversations (multi-turn chat): ``"conversations": [{"first": [ids...], "users": [[ids...], ...]}, ...]``
instead of ``"prompts"``; a conversation may set its own ``"max_tokens"`` (a number, or one per turn) and
``"kv_transfer_params"`` (every turn's), and ``"stop_from": {"conversation", "turn", "index"}``: every turn
stops on the token an earlier conversation's turn generated at that index (``stop_token_ids``; it runs
first when its index is lower), so a turn ends on a stop token rather than its length.
Turn 1's prompt is ``first``; turn k+1's prompt is turn k's prompt, plus the tokens the engine
generated in turn k, plus ``users[k-1]``. The conversations take turns (A1, B1, A2, B2, ...).
A reasoning model's chat: ``"think": {"open": [ids], "answers": [[ids], ...]}``: every turn's prompt ends with
``open`` (the generation prompt's ``<think>``), the engine's tokens are the thinking part, and a reasoning
template drops it (and ``open``) from the next prompt: turn k+1's prompt is turn k's without ``open``, plus
``answers[k-1]``, plus ``users[k-1]``, plus ``open``.
``"phases": [{"reset": bool}, ...]`` runs them all once per phase, from an emptied vLLM cache;
``"reset": true`` empties it before every turn (hits come only from hkvd), ``false`` keeps it (the
reference run of vLLM's own prefix cache).
``"pause_before": [i]`` pauses before phase i (the test stops the daemon there, so the reference phase
gets nothing from hkvd), or before prompt i; with ``"pause_after_reset": true`` the pause before a prompt
comes after the reset of vLLM's cache (the previous prompt's stores are done, and no engine step runs until
the prompt's own lookup). ``"connector": false`` starts the engine without hkvd.

Processes: a TP=1 engine runs vLLM's engine core in this process
(``hkvd.shim.testing.vllm_cache.place_engine_core``), so the connector's scheduler and worker sides share
it, as in a single-GPU engine core. ``"processes": true`` keeps vLLM's own CPU topology instead (engine
core and worker each in a process of its own); tensor-parallel runs always have it. A core in this process
takes a step only when asked, so after each request the script steps it until the request's stores and
checks are done (``vllm_cache.settle``), as vLLM's own core loop does by itself.
``"vllm_metrics": true`` turns vLLM's stats on and adds ``"vllm_metrics"`` to the output: vLLM's own
``vllm:hkvd_*`` counters (``hkvd.shim.connector_stats``), name (and ``outcome``, for the loads, or ``reason``, for
the decode chunks not stored) -> value, and the
sampled checks' largest error per group kind (``vllm:hkvd_verify_max_error{kind}``); in conversation mode, a list
of them, read after each phase. Output:
``HKVD_RESULT {"phases": [[[{"tokens", "logprobs", "gaps", "num_cached_tokens", "prompt_len"}, ...turns],
...conversations], ...phases]}``.

A prompt is a list of token ids, or a map: ``{"ids": [...]}`` or ``{"text": "..."}``, plus any of
``"salt"`` (vLLM's ``cache_salt``), ``"lora": [name, int_id, path]``, ``"image": {"seed", "size"}``
(a random RGB image, the same for the same seed) and ``"kv_transfer_params"`` (the request's, as vLLM's
OpenAI server hands them to the connector). ``"llm"`` in the arguments passes more
``LLM(...)`` keyword arguments (``enable_lora``, ``limit_mm_per_prompt``, ...).
"""

from __future__ import annotations

import json
import os
import sys

from hkvd.shim.testing.vllm_cache import place_engine_core, reset_prefix_cache, settle


def _handshake(sync_dir: str, i: int) -> None:
    import time
    from pathlib import Path

    Path(sync_dir, f"paused-{i}").write_text("")
    go = Path(sync_dir, f"go-{i}")
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {go} within 120 s")
        time.sleep(0.05)


def main() -> None:
    args = json.loads(sys.argv[1])
    if args.get("omp_bind"):  # per-rank CPU binding for tensor-parallel runs ("0|1")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args["omp_bind"]
    place_engine_core(args)  # see the module doc, "Processes"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # Sampled verification off unless asked for ("extra": {"verify_fraction": 1}): vLLM's request ids carry a
    # random suffix, so its default 1 % would recompute a random hit now and then, and the tests count hits.
    extra = {"socket_path": args["socket"], "reconnect_interval_s": 0.5, "verify_fraction": 0.0,
             **args.get("extra", {})}
    kw = {}
    if args.get("mamba_cache_mode"):
        kw["mamba_cache_mode"] = args["mamba_cache_mode"]
    if args.get("retention") is not None:
        kw["prefix_cache_retention_interval"] = args["retention"]
    if args.get("vllm_metrics"):
        kw["disable_log_stats"] = False  # the engine's stats reach vLLM's Prometheus counters
    kw.update(args.get("llm", {}))
    kw.setdefault("max_model_len", 1024)
    if args.get("max_num_batched_tokens", 128):  # 0: vLLM's default budget
        kw["max_num_batched_tokens"] = args.get("max_num_batched_tokens", 128)
    if args.get("connector", True):
        kw["kv_transfer_config"] = {
            "kv_connector": "HkvdConnector", "kv_connector_module_path": "hkvd.shim.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": extra,
        }
    llm = LLM(model=args["model"], enforce_eager=True, dtype="bfloat16", enable_prefix_caching=True, seed=0, **kw)
    sp = SamplingParams(max_tokens=args.get("max_tokens", 8), temperature=0.0, logprobs=args.get("logprobs", 1),
                        ignore_eos=bool(args.get("ignore_eos", False)))
    if "conversations" in args:
        phases, phase_metrics = [], []
        for i, phase in enumerate(args.get("phases", [{"reset": True}])):
            if i in args.get("pause_before", []):
                _handshake(args["sync_dir"], i)
            reset_prefix_cache(llm)
            phases.append(_chat(llm, sp, args["conversations"], bool(phase.get("reset", True)), TokensPrompt))
            if args.get("vllm_metrics"):  # the counters after each phase
                phase_metrics.append(_hkvd_metrics())
        out_chat: dict = {"phases": phases}
        if args.get("vllm_metrics"):
            out_chat["vllm_metrics"] = phase_metrics
        print("HKVD_RESULT " + json.dumps(out_chat), flush=True)
        return
    results = []
    after_reset = bool(args.get("pause_after_reset"))
    for i, spec in enumerate(args["prompts"]):
        if i in args.get("pause_before", []) and not after_reset:
            # The test restarts the daemon here, while this engine lives on.
            _handshake(args["sync_dir"], i)
        reset_prefix_cache(llm)
        if i in args.get("pause_before", []) and after_reset:
            _handshake(args["sync_dir"], i)
        prompt, lora = _prompt(spec, TokensPrompt)
        params = sp
        if isinstance(spec, dict) and "kv_transfer_params" in spec:  # as vLLM's OpenAI server passes them on
            params = sp.clone()
            params.extra_args = {"kv_transfer_params": spec["kv_transfer_params"]}
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=lora)[0]
        settle(llm)  # see the module doc, "Processes"
        comp = out.outputs[0]
        lps = [float(d[t].logprob) for t, d in zip(comp.token_ids, comp.logprobs or [], strict=False)]
        results.append({"tokens": list(comp.token_ids), "logprobs": lps,
                        "num_cached_tokens": int(out.num_cached_tokens or 0)})
    # vLLM's block size N (hybrids align it to the Mamba state page): the granularity of every hit.
    block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
    out = {"results": results, "block_size": block_size,
           "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
           "pid": os.getpid()}
    if args.get("vllm_metrics"):
        out["vllm_metrics"] = _hkvd_metrics()
    print("HKVD_RESULT " + json.dumps(out), flush=True)


def _hkvd_metrics():  # type: ignore[no-untyped-def]
    """vLLM's ``vllm:hkvd_*`` counters, summed over their labels except ``outcome``. Read from prometheus-client's
    registry in this process (vLLM's front end): ``LLM.get_metrics()`` rounds counters down to integers."""
    from prometheus_client import REGISTRY

    got: dict[str, float] = {}
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if fam.name.startswith("vllm:hkvd_") and s.name.endswith("_total"):
                label = s.labels.get("outcome") or s.labels.get("reason")
                name = fam.name + (f"{{{label}}}" if label else "")
                got[name] = got.get(name, 0.0) + float(s.value)
            elif fam.name == "vllm:hkvd_verify_max_error":  # a gauge per group kind: the largest over engines
                name = f"{fam.name}{{{s.labels['kind']}}}"
                got[name] = max(got.get(name, 0.0), float(s.value))
    return got


def _chat(llm, sp, convs, reset, tokens_prompt):  # type: ignore[no-untyped-def]
    """Run the conversations turn by turn (see the module doc); one list of turn results per conversation."""
    prompts = [list(c["first"]) for c in convs]
    out: list[list[dict]] = [[] for _ in convs]
    for turn in range(1 + max(len(c["users"]) for c in convs)):
        for i, c in enumerate(convs):
            if turn > len(c["users"]):
                continue
            think = c.get("think")
            if turn:
                said = list(think["answers"][turn - 1]) if think else out[i][-1]["tokens"]
                prompts[i] += said + list(c["users"][turn - 1])
            prompt = prompts[i] + list(think["open"]) if think else prompts[i]
            if reset:
                reset_prefix_cache(llm)
            params = sp.clone()
            wanted = c.get("max_tokens", sp.max_tokens)
            params.max_tokens = wanted[turn] if isinstance(wanted, list) else wanted
            if c.get("kv_transfer_params"):  # every turn's, as vLLM's OpenAI server passes them on
                params.extra_args = {"kv_transfer_params": c["kv_transfer_params"]}
            if c.get("stop_from"):  # stop on a token another conversation's turn generated (see the module doc)
                src = c["stop_from"]
                params.stop_token_ids = [out[src["conversation"]][src["turn"]]["tokens"][src["index"]]]
                params.ignore_eos = False
            res = llm.generate([tokens_prompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
            settle(llm)
            comp = res.outputs[0]
            steps = list(zip(comp.token_ids, comp.logprobs or [], strict=False))
            # gaps: the top-1 minus the top-2 logprob at each step (needs "logprobs": 2); a near-tie
            # there may flip between runs whose KV differs by a bf16 rounding.
            out[i].append({"tokens": list(comp.token_ids), "logprobs": [float(d[t].logprob) for t, d in steps],
                           "gaps": [_gap(d) for _, d in steps], "prompt_len": len(prompt),
                           "num_cached_tokens": int(res.num_cached_tokens or 0),
                           "finish_reason": comp.finish_reason})
    return out


def _gap(top):  # type: ignore[no-untyped-def]
    lps = sorted((float(x.logprob) for x in top.values()), reverse=True)
    return lps[0] - lps[1] if len(lps) > 1 else None


def _prompt(spec, tokens_prompt):  # type: ignore[no-untyped-def]
    """(vLLM prompt, LoRARequest or None) for one prompt of the arguments (see the module doc)."""
    if isinstance(spec, list):
        return tokens_prompt(prompt_token_ids=spec), None
    prompt = tokens_prompt(prompt_token_ids=spec["ids"]) if "ids" in spec else {"prompt": spec["text"]}
    if spec.get("salt"):
        prompt["cache_salt"] = spec["salt"]
    if spec.get("image"):
        import numpy as np
        from PIL import Image

        img = spec["image"]
        rng = np.random.default_rng(img["seed"])
        pixels = rng.integers(0, 256, (img["size"], img["size"], 3), dtype=np.uint8)
        prompt["multi_modal_data"] = {"image": Image.fromarray(pixels)}
    lora = None
    if spec.get("lora"):
        from vllm.lora.request import LoRARequest

        name, int_id, path = spec["lora"]
        lora = LoRARequest(name, int_id, path)
    return prompt, lora


if __name__ == "__main__":
    main()
