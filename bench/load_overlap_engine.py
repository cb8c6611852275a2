"""One vLLM engine (CPU) for ``bench.load_overlap`` and its test; prints one JSON line last.

    python -m bench.load_overlap_engine '{"model": DIR, "socket": PATH, "rounds": [[[ids...], ...], ...],
                                          "decode_prompt": [ids...], "decode_tokens": 200, "prefix_gap": 8,
                                          "answer_tokens": 1, "max_model_len": 8192, "batched": 2048}'
    python -m bench.load_overlap_engine @FILE   (the same JSON in a file)

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank: vLLM's uniproc
executor), so the driver steps it (``LLMEngine.step``) and reads the worker half of the connector
(``hkvd.shim.loads.Loads``: loads started, in flight) between steps. Per round of prefix prompts:

1. **store**: each prefix prompt is generated alone (greedy, ``answer_tokens`` tokens): computed and
   stored in hkvd; its answer is the reference. vLLM's prefix cache is reset before each and
   after the last (``Driver.reset``).
2. **decode**: request A (``decode_prompt``) decodes ``decode_tokens`` tokens, one per step. After
   every ``prefix_gap`` tokens of A, once the previous one has finished, the round's next prefix
   prompt arrives; vLLM's prefix cache was reset, so its prefix is loaded from hkvd while A keeps
   decoding.

Per step of phase 2: the wall-clock time after the step (``t``), the tokens A got (``a``), how many
prefix prompts were unfinished when it began (``pending``), whether a load was in flight when it began
(``busy``), how many loads started in it (``started``) and how many were in flight when it ended
(``in_flight``); where the step's time went: its length (``step_ms``), the stepping thread's time on a
CPU and waiting for one (``cpu_ms``, ``runqueue_ms``, from the kernel's schedstat), and the ms spent
in each connector hook and engine phase (``hooks_ms``, ``HookClock``). With ``HKVD_BENCH_ENGINE_CPUS``
(a comma-separated CPU list) the process, and every thread it starts, runs on those CPUs only.
Each prefix prompt's answer and ``num_cached_tokens`` come beside its reference.
Output: ``HKVD_BENCH {"startup_s", "rounds": [{"steps": [...], "prefixes": [{"reference", "loaded"}]}],
"loads": {Loads.stats}}``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from hkvd.shim.testing.vllm_cache import reset_prefix_cache


def _answer(out: Any) -> dict[str, Any]:
    comp = out.outputs[0]
    lps = [float(d[t].logprob) for t, d in zip(comp.token_ids, comp.logprobs or [], strict=False)]
    return {"tokens": list(comp.token_ids), "logprobs": lps, "num_cached_tokens": int(out.num_cached_tokens or 0)}


HOOKS = {"scheduler": ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                       "update_connector_output", "request_finished_all_groups"),
         "worker": ("handle_preemptions", "start_load_kv", "wait_for_save", "get_transfer_results")}


class HookClock:
    """Milliseconds spent in each hook of the connector's two halves, per step (``take``)."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    def wrap(self, obj: Any, names: tuple[str, ...]) -> None:
        for name in names:
            fn = getattr(obj, name)

            def timed(*a: Any, _fn: Any = fn, _name: str = name, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    self.ms[_name] = self.ms.get(_name, 0.0) + (time.perf_counter() - t) * 1e3
            setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        ms, self.ms = self.ms, {}
        return {k: round(v, 3) for k, v in ms.items()}


def scheduler_connector(llm: Any) -> Any:
    """The SCHEDULER-role connector of an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def _schedstat() -> tuple[int, int]:
    """(ns on a CPU, ns waiting for one) of the calling thread, from the kernel's schedstat."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        on_cpu, waiting, _ = f.read().split()
    return int(on_cpu), int(waiting)


class Driver:
    def __init__(self, llm: Any, loads: Any, args: dict[str, Any], clock: HookClock | None = None) -> None:
        from vllm import SamplingParams

        self.llm, self.engine, self.loads = llm, llm.llm_engine, loads
        self.decode_sp = SamplingParams(max_tokens=int(args["decode_tokens"]), temperature=0.0, ignore_eos=True)
        self.answer_sp = SamplingParams(max_tokens=int(args.get("answer_tokens", 4)), temperature=0.0, logprobs=1,
                                        ignore_eos=True)
        self.n = 0
        self.clock = clock or HookClock()

    def _id(self, what: str) -> str:
        self.n += 1
        return f"{what}-{self.n}"

    def decode(self, prompt: list[int], prefixes: list[list[int]], gap: int) -> tuple[list[dict], list[dict]]:
        """Step the engine until A is done; a prefix prompt arrives after every ``gap`` tokens of A."""
        from vllm.inputs import TokensPrompt

        a = self._id("decode")
        self.engine.add_request(a, TokensPrompt(prompt_token_ids=prompt), self.decode_sp)
        steps: list[dict[str, Any]] = []
        answers: dict[str, Any] = {}
        order: list[str] = []
        todo = list(prefixes)
        a_tokens = since = 0
        a_done = False
        while self.engine.has_unfinished_requests():
            pending = len(order) - len(answers)
            if not a_done and todo and since >= gap and not pending:
                rid = self._id("prefix")
                order.append(rid)
                self.engine.add_request(rid, TokensPrompt(prompt_token_ids=todo.pop(0)), self.answer_sp)
                since, pending = 0, 1
            started, busy = self.loads.stats["loads_started"], self.loads.in_flight > 0
            self.clock.take()
            sched0 = _schedstat()
            t0 = time.perf_counter()
            outs = self.engine.step()
            now = time.perf_counter()
            sched1 = _schedstat()
            got = 0
            for out in outs:
                if out.request_id == a:
                    got = len(out.outputs[0].token_ids) - a_tokens
                    a_tokens += got
                    a_done = out.finished
                elif out.finished:
                    answers[out.request_id] = _answer(out)
            since += got
            steps.append({"t": now, "a": got, "pending": pending, "busy": busy,
                          "started": self.loads.stats["loads_started"] - started, "in_flight": self.loads.in_flight,
                          "step_ms": round((now - t0) * 1e3, 3), "hooks_ms": self.clock.take(),
                          "cpu_ms": round((sched1[0] - sched0[0]) / 1e6, 3),
                          "runqueue_ms": round((sched1[1] - sched0[1]) / 1e6, 3)})
        if todo:
            raise RuntimeError(f"A finished with {len(todo)} prefix prompts left: raise decode_tokens")
        return steps, [answers[r] for r in order]

    def reset(self, timeout_s: float = 60.0) -> None:
        """Empty vLLM's prefix cache (hkvd keeps its entries); see ``hkvd.shim.testing.vllm_cache``."""
        reset_prefix_cache(self.llm, timeout_s)

    def alone(self, prompts: list[list[int]]) -> list[dict[str, Any]]:
        from vllm.inputs import TokensPrompt

        out = []
        for ids in prompts:
            self.reset()
            out.append(_answer(self.llm.generate([TokensPrompt(prompt_token_ids=ids)], self.answer_sp,
                                                 use_tqdm=False)[0]))
        return out


def main() -> None:
    arg = sys.argv[1]
    if arg.startswith("@"):  # the arguments in a file: thousands of token ids pass a command line's limit
        with open(arg[1:]) as f:
            arg = f.read()
    args = json.loads(arg)
    if os.environ.get("HKVD_BENCH_ENGINE_CPUS"):  # every thread started from here on inherits it
        os.sched_setaffinity(0, {int(c) for c in os.environ["HKVD_BENCH_ENGINE_CPUS"].split(",")})
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    t0 = time.perf_counter()
    from vllm import LLM
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm = LLM(model=args["model"], enforce_eager=True, dtype="bfloat16", max_model_len=int(args["max_model_len"]),
              enable_prefix_caching=True, max_num_batched_tokens=int(args["batched"]), seed=0,
              kv_transfer_config={
                  "kv_connector": "HkvdConnector", "kv_connector_module_path": "hkvd.shim.connector",
                  "kv_role": "kv_both",
                  # Every hit loaded (sampled verification would recompute a random 1 % of them).
                  "kv_connector_extra_config": {"socket_path": args["socket"], "reconnect_interval_s": 0.5,
                                                "verify_fraction": 0.0}})
    startup = time.perf_counter() - t0
    connector = get_kv_transfer_group()  # the worker-role connector, in this process
    worker = connector._worker
    clock = HookClock()
    clock.wrap(connector, HOOKS["worker"])
    clock.wrap(scheduler_connector(llm), HOOKS["scheduler"])
    core = llm.llm_engine.engine_core.engine_core  # the engine's own phases, beside the hooks
    clock.wrap(core.scheduler, ("schedule", "update_from_output"))
    clock.wrap(core.model_executor, ("execute_model", "sample_tokens"))
    clock.wrap(llm.llm_engine.output_processor, ("process_outputs",))
    d = Driver(llm, worker.loads, args, clock)
    rounds = []
    for prefixes in args["rounds"]:
        reference = d.alone(prefixes)  # computed and stored
        d.reset()  # every cached token of the prefix prompts below now comes from hkvd
        steps, answers = d.decode(args["decode_prompt"], prefixes, int(args["prefix_gap"]))
        rounds.append({"steps": steps, "prefixes": [{"reference": r, "loaded": a}
                                                    for r, a in zip(reference, answers, strict=True)]})
    res = {"startup_s": startup, "rounds": rounds, "loads": dict(worker.loads.stats)}
    print("HKVD_BENCH " + json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
