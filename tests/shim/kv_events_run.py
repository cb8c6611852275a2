# SPDX-License-Identifier: Apache-2.0
"""One vLLM engine with the hkvd connector and vLLM's own KV events on; prints one JSON line.

Run by tests/shim/test_kv_events_vllm.py:

    python tests/shim/kv_events_run.py '{"model": DIR, "socket": PATH, "events": "ipc://...",
                                         "replay": "ipc://...", "prompts": [[ids...] | {"ids", "salt"}], ...}'

The engine publishes with ``kv_events_config`` (publisher zmq, PUB on ``events``, ROUTER on
``replay``): vLLM's own GPU events and, through the connector's ``take_events``, hkvd's events for
this engine. The prompts run one at a time; then tiny requests drive steps for ``drain_s`` seconds,
so the connector polls the events of the last stores (they turn servable after the last prompt's
step); then the script asks vLLM's replay socket for every batch from sequence number 0, which
catches what a subscriber would have missed before it connected. Output:
``HKVD_RESULT {"batches": [[seq, payload hex], ...], "block_size": N}``.
"""

from __future__ import annotations

import json
import os
import sys
import time

from hkvd.shim.testing.vllm_cache import place_engine_core, settle


def _replay(endpoint: str, timeout_s: float = 30.0) -> list[list[object]]:
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    end = (-1).to_bytes(8, "big", signed=True)
    out: list[list[object]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sock.poll(1000):
            continue
        _, _topic, seq, payload = sock.recv_multipart()
        if seq == end:
            break
        out.append([int.from_bytes(seq, "big"), payload.hex()])
    sock.close()
    return out


def main() -> None:
    args = json.loads(sys.argv[1])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    place_engine_core(args)  # the engine core in this process unless tensor-parallel or asked otherwise
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(args.get("llm", {}))
    if args.get("retention") is not None:
        kw["prefix_cache_retention_interval"] = args["retention"]
    llm = LLM(
        model=args["model"], enforce_eager=True, dtype="bfloat16", enable_prefix_caching=True, seed=0,
        max_model_len=1024, max_num_batched_tokens=args.get("max_num_batched_tokens", 128),
        kv_transfer_config={
            "kv_connector": "HkvdConnector", "kv_connector_module_path": "hkvd.shim.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"socket_path": args["socket"], "verify_fraction": 0.0,  # hits counted
                                          **args.get("extra", {})},
        },
        kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": args["events"],
                          "replay_endpoint": args["replay"]},
        **kw,
    )
    sp = SamplingParams(max_tokens=args.get("max_tokens", 8), temperature=0.0, ignore_eos=True)
    for spec in args["prompts"]:
        ids, salt = (spec, None) if isinstance(spec, list) else (spec["ids"], spec.get("salt"))
        prompt = TokensPrompt(prompt_token_ids=ids)
        if salt:
            prompt["cache_salt"] = salt
        llm.generate([prompt], sp, use_tqdm=False)
        settle(llm)  # the engine core in this process steps only when asked (e2e_run's "Processes")
    # Steps after the last prompt: its finish-time stores complete, the connector polls their events.
    deadline = time.monotonic() + args.get("drain_s", 2.0)
    while time.monotonic() < deadline:
        llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], SamplingParams(max_tokens=2), use_tqdm=False)
        time.sleep(0.05)
    time.sleep(0.5)  # vLLM's publisher thread sends what the last step queued
    batches = _replay(args["replay"])
    block_size = int(llm.llm_engine.vllm_config.cache_config.block_size)
    print("HKVD_RESULT " + json.dumps({"batches": batches, "block_size": block_size}), flush=True)


if __name__ == "__main__":
    main()
