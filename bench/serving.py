"""serving: multi-turn chats through vLLM's OpenAI server, more conversations than its KV memory holds.

Workload (``bench.serving_client.Workload``): 8 conversations (4 in quick mode), 4 (2) of them
in flight at a time, 4 (3) turns each. Turn 1 sends a 1,500-token (600) message; every later
turn sends the whole conversation so far (previous prompt, the model's answer, a new 200-token
(100) user message). Answers are greedy, ``ignore_eos``, 128 (32) tokens, so every run sends
prompts of the same lengths. A conversation goes to the back of the queue after each turn, so
between two of its turns the other conversations run theirs (all but the ones in flight then).

Runs, one after another in one invocation, each a fresh server (and daemon) with the same
flags (``--enable-prefix-caching --mamba-cache-mode align --prefix-cache-retention-interval N``,
the Mamba cache mode for Qwen3-Next-shaped models only; the same OpenMP binding,
``--num-gpu-blocks-override``), in rounds (``rounds``: 3 by default, 1
in quick mode; a run that fails is not tried again). Each run's figures pool the replies of all
its rounds, and the summary gives the ratio to the limit round by round as well, which shows how
much one round's figure can drift on a shared machine:

1. ``limit``: vLLM alone with ample KV memory (every conversation twice over): its own prefix
   cache keeps every conversation, the best a cache can do;
2. ``recompute``: vLLM alone with small KV memory (the running conversations and a quarter
   more): each conversation is evicted before it comes back and is computed again;
3. ``hkvd``: the same small memory, with ``HkvdConnector`` and a fresh ``hkvd serve``;
4. ``lmcache``: the same small memory with LMCache 0.5.6's MP server and its connector, where
   ``.bench-lmcache`` exists (``make bench-peers``); where it does not start or serve, the run
   records the error it got.

Reported per run and turn: TTFT p50 and p99 (from the client: request sent to the first
streamed token), the hit share (prompt tokens the server did not compute, from each reply's
``prompt_tokens_details.cached_tokens``), each stream's output tokens/s after its first token
(median), and per run the output tokens/s of the whole run. Later turns (2 and on) pooled give
the targets, as ratios measured in the same invocation: hkvd's TTFT p50 at most 1.1x the
limit's and at most 0.5x recompute's, its hit share at least the limit's. Replies are not
compared across runs: batches follow arrival times, and a random-weight model's near-tied
greedy tokens flip with the batch (the two vLLM-alone runs' answers differ too); tests/shim
checks hkvd's outputs token for token.

``in_step_loads`` (``--in-step-loads``) has the hkvd run load its hits in the step that plans them (docs/design.md
"In-step loads"; recorded in the config; the result goes to ``serving_in_step.json``).
``HKVD_BENCH_VERIFY_FRACTION`` sets the hkvd run's ``verify_fraction`` (default 0 here: every hit loaded; the
daemon's verify counts then come with the run; recorded in the config). ``HKVD_BENCH_DAEMON_ARGS`` adds ``hkvd serve``
arguments to the hkvd runs (recorded in the config). ``HKVD_BENCH_VLLM_ARGS`` adds
``vllm serve`` arguments to every run (recorded in the config). vLLM
turns its asynchronous scheduling off on CPU (``vllm/platforms/cpu.py``), so here a step's output
is read before the next step is planned, and a load reported at the end of step k lets its
request run in step k + 1 (on GPUs, asynchronous scheduling is vLLM's default: k + 2, unless the
scheduler side reported the load first: ``early_load_reports``).

Models (``model``; ``--serving-model``): ``qwen3_next_8l`` (8 layers, hidden 512: prefill is real
compute on 2 cores) by default, the tiny 4-layer ``qwen3_next`` of tests/shim in quick mode; both
Qwen3-Next-shaped (3 Gated-DeltaNet layers per full-attention layer). ``gemma3``: the tiny Gemma3
of tests/shim (3 sliding-window layers, window 192, per full-attention layer; no Mamba state), whose
2,048 positions hold the quick workload only: the full one's conversations (2,612 tokens) make every
run an error that says so. Each model carries the geometry vLLM gives it (block size N = 128 for
all three, 4 KV-cache groups), which every server start checks against vLLM's log, and the KV
memory is sized from it (``BenchModel.kv_blocks``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.common import Daemon, median, percentile, tree_cpu_s
from bench.serving_client import (
    Reply,
    Workload,
    cached_tokens,
    converse,
    http_get,
    parse_metrics,
    reply_from_json,
    stream_completion,
)
from bench.serving_server import (
    HOST,
    MAX_NUM_BATCHED_TOKENS,
    MODEL_NAME,
    MODELS,
    BenchModel,
    LmcacheServer,
    VllmServer,
    extra_daemon_args,
    extra_vllm_args,
    lmcache_env,
    model_path,
)

BLOCK = MODELS["qwen3_next"].block  # the default models' block size N (each model carries its own)
FULL = Workload(conversations=8, concurrency=4, turns=4, first_tokens=1500, user_tokens=200, answer_tokens=128)
QUICK = Workload(conversations=4, concurrency=2, turns=3, first_tokens=600, user_tokens=100, answer_tokens=32)
RUNS = {
    "limit": "vLLM alone, ample KV memory",
    "recompute": "vLLM alone, small KV memory",
    "hkvd": "vLLM + hkvd, small KV memory",
    "lmcache": "vLLM + LMCache MP, small KV memory",
}
# At most; hits: at least the limit's. The limit's bound is the one of the issue "Hits that pay" (1.05x).
TARGETS = {"hkvd_vs_limit_ttft": 1.05, "hkvd_vs_recompute_ttft": 0.5}
START_TIMEOUT_S = 900.0  # a vLLM server start: ~45 s alone, minutes on a loaded 2-core machine
REQUEST_TIMEOUT_S = 600.0
Log = Callable[[str], None]


def _stats(turn: int | str, rs: Sequence[Reply]) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in rs)
    cached = sum(r.cached_tokens for r in rs)
    ttft = [r.ttft_s * 1e3 for r in rs]
    return {"turn": turn, "requests": len(rs), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_share": cached / prompt if prompt else float("nan"), "ttft_ms_p50": median(ttft),
            "ttft_ms_p99": percentile(ttft, 99), "stream_tok_s_p50": median([r.decode_tok_s() for r in rs])}


def turn_stats(replies: Sequence[Reply], turns: int) -> list[dict[str, Any]]:
    """Per turn (1-based), then ``"later"`` (turns 2 and on pooled): TTFT p50/p99 ms, hit share, tok/s."""
    groups: list[tuple[int | str, list[Reply]]] = [(t, [r for r in replies if r.turn == t])
                                                   for t in range(1, turns + 1)]
    groups.append(("later", [r for r in replies if r.turn >= 2]))
    return [_stats(turn, rs) for turn, rs in groups if rs]


def _later(run: dict[str, Any]) -> dict[str, Any] | None:
    return next((t for t in run.get("turns", []) if t["turn"] == "later"), None)


def rounds_of(runs: Sequence[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Each round's runs, from the merged runs' own ``rounds`` (a run that failed has none)."""
    n = max((len(r.get("rounds") or ()) for r in runs), default=0)
    return [[r["rounds"][i] for r in runs if i < len(r.get("rounds") or ())] for i in range(n)]


def clear_spread(targets: dict[str, Any], each: Sequence[dict[str, Any]]) -> None:
    """Give every measured target its value in each round (``each``: the rounds' own targets) and leave it met
    only where every round's value meets it too."""
    for key, t in targets.items():
        if t is not None:
            t["rounds"] = [None if e.get(key) is None else e[key]["value"] for e in each]
            t["met"] = t["met"] and all(e.get(key) is not None and e[key]["met"] for e in each)


def ratios(runs: Sequence[dict[str, Any]], rounds: Sequence[Sequence[dict[str, Any]]] = ()) -> dict[str, Any]:
    """Later-turn TTFT p50 and hit share of every run that served against the limit's and recompute's.

    ``targets``: hkvd's three checks (``None`` where a run they need is missing), each with
    the measured value, the bound and whether it is met. With more than one of ``rounds`` (each round's runs),
    each target lists its value round by round and is met only where the pooled value and every round's are
    (it clears the spread).
    """
    later = {r["run"]: lt for r in runs if (lt := _later(r)) is not None}
    out: dict[str, Any] = {"ttft_p50_vs_limit": {}, "ttft_p50_vs_recompute": {}, "hit_share": {}}
    for name, lt in later.items():
        out["hit_share"][name] = lt["hit_share"]
        for ref in ("limit", "recompute"):
            if ref in later and name != ref:
                out[f"ttft_p50_vs_{ref}"][name] = lt["ttft_ms_p50"] / later[ref]["ttft_ms_p50"]
    targets: dict[str, Any] = {}
    if "hkvd" in later:
        for ref in ("limit", "recompute"):
            bound = TARGETS[f"hkvd_vs_{ref}_ttft"]
            value = out[f"ttft_p50_vs_{ref}"].get("hkvd")
            targets[f"hkvd_vs_{ref}_ttft"] = None if value is None else {
                "value": value, "at_most": bound, "met": value <= bound}
        if "limit" in later:
            value, bound = later["hkvd"]["hit_share"], later["limit"]["hit_share"]
            targets["hkvd_hit_share"] = {"value": value, "at_least": bound, "met": value >= bound}
    if len(rounds) > 1:
        clear_spread(targets, [ratios(rnd)["targets"] for rnd in rounds])
    out["targets"] = targets
    if "hkvd" in later and "limit" in later and later["hkvd"]["stream_tok_s_p50"]:
        # vLLM runs a request whose load it awaits (WAITING_FOR_REMOTE_KVS) in the step after the
        # one that reports the load: hkvd's later turns take about one more step of the running
        # batch than the limit's, whose hits need no load. The step: hkvd's own inter-token time.
        out["hkvd_over_limit"] = {
            "ttft_p50_ms": later["hkvd"]["ttft_ms_p50"] - later["limit"]["ttft_ms_p50"],
            "decode_step_ms_p50": 1e3 / later["hkvd"]["stream_tok_s_p50"]}
    return out


def warm_up(server: VllmServer) -> None:
    """One short request (less than a block: nothing to cache), so one-off costs land on no measured turn."""
    stream_completion(HOST, server.port, MODEL_NAME, [5 + (i % 7) for i in range(server.block // 2)], 2,
                      REQUEST_TIMEOUT_S)


def timed_reply(server: VllmServer, conv: int, turn: int, prompt: list[int], max_tokens: int, t0: float,
                extra: dict[str, Any] | None = None) -> Reply:
    """One streamed completion as a ``Reply`` (``start_s`` from ``t0``, a ``time.perf_counter`` reading); an
    error where the server counted another number of prompt tokens than were sent."""
    start = time.perf_counter() - t0
    ttft, e2e, usage, tokens = stream_completion(HOST, server.port, MODEL_NAME, prompt, max_tokens,
                                                 REQUEST_TIMEOUT_S, extra)
    if usage["prompt_tokens"] != len(prompt):
        raise RuntimeError(f"the server counted {usage['prompt_tokens']} prompt tokens, {len(prompt)} were sent")
    return Reply(conv, turn, len(prompt), cached_tokens(usage), int(usage["completion_tokens"]), start, ttft, e2e,
                 tuple(tokens))


def _play(server: VllmServer, workload: Workload, log: Log, also: Sequence[int] = ()) -> dict[str, Any]:
    """The workload against a started server: replies, per-turn stats, the server's counters, and ``cpu_s``:
    the CPU seconds the server's processes (and the processes ``also``: the daemon) spent on it."""
    warm_up(server)
    before = parse_metrics(http_get(HOST, server.port, "/metrics", 30.0)[1])
    done: dict[int, list[Reply]] = {}
    cpu0 = tree_cpu_s([server.pid, *also])
    t0 = time.perf_counter()

    def send(conv: int, turn: int, prompt: list[int]) -> Reply:
        return timed_reply(server, conv, turn, prompt, workload.answer_tokens, t0)

    def on_request(r: Reply) -> None:
        done.setdefault(r.turn, []).append(r)
        if len(done[r.turn]) == workload.conversations:
            st = _stats(r.turn, done[r.turn])
            log(f"    turn {r.turn}: {st['requests']} x {st['prompt_tokens'] // st['requests']} prompt tokens, "
                f"TTFT p50 {st['ttft_ms_p50']:.0f} ms p99 {st['ttft_ms_p99']:.0f} ms, hit {st['hit_share']:.1%} "
                f"({time.perf_counter() - t0:.0f} s)")

    replies = converse(workload, send, on_request)
    wall = time.perf_counter() - t0
    cpu = tree_cpu_s([server.pid, *also]) - cpu0
    after = parse_metrics(http_get(HOST, server.port, "/metrics", 30.0)[1])
    counters = {k: after[k] - before[k] for k in after}
    return {"replies": replies, "wall_s": wall, "cpu_s": cpu, "counters": counters,
            "output_tok_s": sum(r.completion_tokens for r in replies) / wall, "errors_logged": server.errors()}


def _one_run(name: str, model_dir: Path, model: BenchModel, max_len: int, workload: Workload, blocks: int,
             hugepages: str, lmcache_venv: Path | None, log: Log, in_step: bool = False) -> dict[str, Any]:
    """One run in fresh processes (``in_step``: the hkvd run's engine loads hits in the step that plans them);
    a run that cannot start or serve returns ``{"error": ...}``, and so does one whose conversations outgrow
    ``max_len`` or whose ``blocks`` hold less than one conversation of ``model`` (before starting anything)."""
    base: dict[str, Any] = {"run": name, "label": RUNS[name], "kv_blocks": blocks}
    t0 = time.perf_counter()
    block = model.block
    if workload.context_tokens() > max_len:
        msg = (f"conversations reach {workload.context_tokens()} tokens, over the max model len {max_len} "
               f"({model.name} has {model.max_len} positions): use --quick's workload or a model with more "
               "positions (--serving-model)")
        log(f"    {name} not run: {msg}")
        return {**base, "error": msg, "error_detail": msg}
    need = model.kv_blocks(workload)["per_conversation"]
    if blocks < need:
        msg = (f"{blocks} KV blocks hold less than one conversation: {model.name} needs {need} "
               f"(blocks of {block} tokens in {model.kv_groups()} groups): size the memory with "
               f"MODELS[{model.name!r}].kv_blocks(workload)")
        log(f"    {name} not run: {msg}")
        return {**base, "error": msg, "error_detail": msg}

    def serve(kv: dict[str, Any] | None, env: dict[str, str] | None = None, also: Sequence[int] = ()) -> dict[str, Any]:
        with VllmServer(model_dir, max_len, block, blocks, kv, START_TIMEOUT_S, env,
                        mamba_align=model.mamba_groups() > 0) as server:
            geo = server.geometry()
            log(f"    server up in {server.startup_s:.0f} s: KV cache groups {geo['group_block_sizes']}, "
                f"{blocks} blocks = {geo['kv_cache_tokens']} tokens by vLLM's count")
            if geo["block"] != block or len(geo["group_block_sizes"] or ()) != model.kv_groups():
                raise RuntimeError(f"vLLM chose block {geo['block']} and groups {geo['group_block_sizes']}; the bench "
                                   f"sized the KV memory for block {block} and {model.kv_groups()} groups")
            return {**_play(server, workload, log, also), "geometry": geo, "startup_s": server.startup_s}

    try:
        if name == "hkvd":
            with Daemon("--chunk-size", str(block), *extra_daemon_args(), pool_gb=2.0, hugepages=hugepages) as daemon:
                kv = {"kv_connector": "HkvdConnector", "kv_connector_module_path": "hkvd.shim.connector",
                      "kv_role": "kv_both", "kv_connector_extra_config": {"socket_path": daemon.socket_path,
                                                                          "require_daemon": True,
                                                                          "verify_fraction": verify_fraction(),
                                                                          "in_step_loads": in_step}}
                res = serve(kv, also=[daemon.proc.pid] if daemon.proc is not None else [])
                status = daemon.status()
                res["daemon"] = {k: status["index"][k] for k in ("entries", "bytes_stored", "evictions",
                                                                 "stores_dropped")}
                # Mamba states lost to the step ordering (late offers, copies past their deadline).
                res["daemon"]["ordering"] = {k: v for k, v in status["counters"].items()
                                             if k.startswith(("step_event", "snapshots_", "copy_"))}
                if verify_fraction():  # the sampled hits' comparisons, per engine layout and group
                    res["daemon"]["verify"] = status.get("verify", {}).get("groups", [])
        elif name == "lmcache":
            if lmcache_venv is None:
                raise RuntimeError("no LMCache venv given: make bench-peers makes .bench-lmcache, which full mode "
                                   "finds by itself (--lmcache-venv DIR for another, or with --quick)")
            with LmcacheServer(lmcache_venv, block, START_TIMEOUT_S) as lm:
                try:
                    res = serve(lm.kv_transfer(), lmcache_env(lmcache_venv, lm.dir / "pythonpath"))
                finally:
                    lm_errors = lm.errors()
                res["lmcache_errors_logged"] = lm_errors
        else:
            res = serve(None)
    except Exception as e:  # recorded: a run that does not work is a result, and the others go on
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        log(f"    {name} failed after {time.perf_counter() - t0:.0f} s: {msg}")
        return {**base, "error": msg, "error_detail": str(e)[-4000:]}
    replies: list[Reply] = res.pop("replies")
    return {**base, **res, "turns": turn_stats(replies, workload.turns), "replies": [r.as_json() for r in replies]}


def _block_counting(model: BenchModel) -> str:
    if model.window_groups():
        return (f"full attention, and as many per sliding-window group up to {model.window_cap()} per request, "
                "no Mamba groups")
    return "attention, and 2 per Mamba group per request"


def verify_fraction() -> float:
    """``HKVD_BENCH_VERIFY_FRACTION``: the hkvd run's sampled verification (``verify_fraction``); 0 by default,
    so every hit is loaded and runs compare. The connector's own default (0.01) recomputes a random 1 %."""
    return float(os.environ.get("HKVD_BENCH_VERIFY_FRACTION", "0"))


def pick_runs(runs: Mapping[str, str], names: Sequence[str] | None) -> dict[str, str]:
    """The runs named in ``names`` (all when None), in ``runs``' order; an error that lists the runs for a name
    that is not one of them."""
    if names is None:
        return dict(runs)
    unknown = [n for n in names if n not in runs]
    if unknown or not names:
        raise ValueError(f"runs {', '.join(unknown) or '(none)'}: not runs of this bench; choose among "
                         f"{', '.join(runs)}")
    return {k: v for k, v in runs.items() if k in names}


def play_rounds(runs: Mapping[str, str], rounds: int, blocks: Mapping[str, int], log: Callable[[str], None],
                one_run: Callable[[str, int], dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Play ``runs`` (name -> what it is) ``rounds`` times in the same order: each round's results, in order.
    ``one_run(name, kv_blocks)`` plays one run; the limit run gets the ample KV blocks, every other the small
    ones. A run that fails (its result has ``error``) is not played again in later rounds."""
    played: list[list[dict[str, Any]]] = []
    failed: set[str] = set()
    for rnd in range(1, rounds + 1):
        played.append([])
        for i, name in enumerate(runs, 1):
            if name in failed:
                continue
            size = blocks["ample"] if name == "limit" else blocks["small"]
            log(f"  round {rnd}/{rounds}, run {i}/{len(runs)} {name}: {runs[name]} ({size} blocks)")
            res = one_run(name, size)
            played[-1].append(res)
            if "error" in res:
                failed.add(name)
    return played


def merge_rounds(played: Sequence[Sequence[dict[str, Any]]], turns: int) -> list[dict[str, Any]]:
    """One run per name from its rounds: replies pooled (the per-turn figures recomputed over them),
    counters and wall time summed, output tokens/s over the summed wall time; ``rounds`` keeps each
    round's own figures. A name whose every round failed keeps its first error."""
    out: list[dict[str, Any]] = []
    for name in RUNS:
        tries = [r for rnd in played for r in rnd if r["run"] == name]
        ok = [r for r in tries if "error" not in r]
        if not ok:
            out.extend(tries[:1])
            continue
        replies = [reply_from_json(j) for r in ok for j in r["replies"]]
        wall = sum(r["wall_s"] for r in ok)
        counters = {k: sum(r["counters"].get(k, 0.0) for r in ok) for k in ok[0]["counters"]}
        merged = {**ok[-1], "wall_s": wall, "counters": counters, "cpu_s": sum(r.get("cpu_s", math.nan) for r in ok),
                  "output_tok_s": sum(r.completion_tokens for r in replies) / wall,
                  "errors_logged": [e for r in ok for e in r.get("errors_logged") or ()],
                  "turns": turn_stats(replies, turns), "replies": [r.as_json() for r in replies]}
        merged["rounds"] = [{k: v for k, v in r.items() if k != "replies"} for r in ok]
        out.append(merged)
    return out


@dataclasses.dataclass(frozen=True)
class Setup:
    """What the serving workload's runs share: the workload, the model (built once), the KV memory in blocks
    (``small``, ``ample``) and the max model len (the longest conversation, in 256-token steps)."""

    workload: Workload
    model: BenchModel
    model_dir: Path
    blocks: dict[str, int]
    max_len: int


def setup(quick: bool, model: str | None) -> Setup:
    """The workload (``QUICK`` or ``FULL``) on ``model`` (default ``qwen3_next_8l``, the tiny ``qwen3_next``
    when quick), its directory built under ``HKVD_TEST_MODELS`` (default /tmp/hkvd-models)."""
    workload = QUICK if quick else FULL
    bench_model = MODELS[model or ("qwen3_next" if quick else "qwen3_next_8l")]
    root = Path(os.environ.get("HKVD_TEST_MODELS") or "/tmp/hkvd-models")
    return Setup(workload, bench_model, model_path(bench_model, root), bench_model.kv_blocks(workload),
                 min(bench_model.max_len, -(-workload.context_tokens() // 256) * 256))


def run(quick: bool, hugepages: str = "auto", log: Log = print, lmcache_venv: str | None = None,
        model: str | None = None, rounds: int | None = None, in_step_loads: bool = False,
        runs: Sequence[str] | None = None) -> dict[str, Any]:
    chosen = pick_runs(RUNS, runs)
    if importlib.util.find_spec("vllm") is None:
        log("  vLLM not installed: make vllm")
        return {"skipped": "vllm not installed (make vllm)", "runs": []}
    st = setup(quick, model)
    workload, bench_model, model_dir, blocks, max_len = st.workload, st.model, st.model_dir, st.blocks, st.max_len
    log(f"  {bench_model.name}: {workload.conversations} conversations x {workload.turns} turns, "
        f"{workload.concurrency} at a time; prompts {workload.prompt_tokens(1)} -> "
        f"{workload.prompt_tokens(workload.turns)} tokens, answers {workload.answer_tokens}")
    log(f"  KV blocks of {bench_model.block} tokens ({_block_counting(bench_model)}): one conversation "
        f"{blocks['per_conversation']}, all {blocks['all_conversations']}; small {blocks['small']}, "
        f"ample {blocks['ample']}; max model len {max_len}")
    venv = Path(lmcache_venv) if lmcache_venv else None
    if rounds is not None and rounds < 1:
        raise ValueError(f"serving rounds: at least 1, got {rounds}")
    rounds = rounds or (1 if quick else 3)
    played = play_rounds(chosen, rounds, blocks, log, lambda name, size: _one_run(
        name, model_dir, bench_model, max_len, workload, size, hugepages, venv, log, in_step_loads))
    merged = merge_rounds(played, workload.turns)
    result = {"config": {"model": bench_model.name, "block": bench_model.block,
                         "workload": dataclasses.asdict(workload),
                         "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS,
                         "kv_blocks": blocks, "max_model_len": max_len, "rounds": rounds,
                         "omp_bind": os.environ.get("HKVD_BENCH_OMP_BIND") or "all usable CPUs",
                         "extra_vllm_args": extra_vllm_args(), "extra_daemon_args": extra_daemon_args(),
                         "verify_fraction": verify_fraction(), "in_step_loads": in_step_loads,
                         "runs": list(chosen)},
              "runs": merged, "ratios": ratios(merged, played),
              # each round's runs carry their own per-turn figures
              "round_ratios": [ratios(rnd)["ttft_p50_vs_limit"] for rnd in played]}
    for line in summary(result):
        log(f"  {line}")
    return result


def summary(result: dict[str, Any]) -> list[str]:
    """The later-turn ratios and the targets, one line each (printed after a run, and in the docs). The ratios
    and targets are computed again from the runs, so the docs follow the bench's current targets."""
    runs = result.get("runs") or []
    rt = ratios(runs, rounds_of(runs)) if runs else (result.get("ratios") or {})
    lines = []
    cfg = result.get("config") or {}
    if cfg.get("kv_blocks"):
        b = cfg["kv_blocks"]
        lines.append(f"{cfg['model']}, KV memory in blocks of {cfg['block']} tokens: small {b['small']}, ample "
                     f"{b['ample']}; one conversation needs {b['per_conversation']}, all of them "
                     f"{b['all_conversations']}")
    for name, v in (rt.get("ttft_p50_vs_limit") or {}).items():
        vs_rc = (rt.get("ttft_p50_vs_recompute") or {}).get(name)
        limit_share = rt["hit_share"].get("limit", float("nan"))
        lines.append(f"{name}: later-turn TTFT p50 {v:.2f}x the limit's"
                     + (f", {vs_rc:.2f}x recompute's" if vs_rc is not None else "")
                     + f"; hit share {rt['hit_share'][name]:.1%} (limit {limit_share:.1%})")
    for key, t in (rt.get("targets") or {}).items():
        if t is None:
            lines.append(f"target {key}: not measured (a run it needs failed)")
        elif "at_most" in t:
            each = t.get("rounds")
            lines.append(f"target {key}: {t['value']:.2f} (at most {t['at_most']}"
                         + (f"; rounds {', '.join('-' if v is None else f'{v:.2f}' for v in each)}" if each else "")
                         + f"): {'met' if t['met'] else 'MISSED'}")
        else:
            lines.append(f"target {key}: {t['value']:.1%} (at least the limit's {t['at_least']:.1%}): "
                         f"{'met' if t['met'] else 'MISSED'}")
    per_round = [r.get("hkvd") for r in result.get("round_ratios") or ()]
    if len(per_round) > 1 and all(v is not None for v in per_round):
        lines.append("hkvd's later-turn TTFT p50 against the limit's, round by round: "
                     + ", ".join(f"{v:.2f}x" for v in per_round))
    if rt.get("hkvd_over_limit") and cfg.get("in_step_loads"):
        x = rt["hkvd_over_limit"]
        lines.append(f"hkvd's later-turn TTFT p50 is {x['ttft_p50_ms']:.0f} ms over the limit's; one decode step of "
                     f"the running batch takes {x['decode_step_ms_p50']:.0f} ms (p50); with in-step loads a hit is "
                     "copied in the step that plans it, so it costs no step that a hit in vLLM's own cache does not")
    elif rt.get("hkvd_over_limit"):
        x = rt["hkvd_over_limit"]
        lines.append(f"hkvd's later-turn TTFT p50 is {x['ttft_p50_ms']:.0f} ms over the limit's; one decode step of "
                     f"the running batch takes {x['decode_step_ms_p50']:.0f} ms (p50); vLLM runs a request whose "
                     "load it awaits in the step after the one whose output reports the load, so a hit from hkvd "
                     "costs its request at least one step that a hit in vLLM's own cache does not")
    by = {r["run"]: r for r in result.get("runs", [])}
    later = {name: lt for name, r in by.items() if (lt := _later(r)) is not None}
    kept = later["recompute"]["hit_share"] if "recompute" in later else 0.0
    if "limit" in later and kept > 0.5 * later["limit"]["hit_share"]:
        lines.append(f"the small KV memory did not evict: recompute still hit {kept:.1%} "
                     "of the later turns' prompt tokens, so the small-memory runs do not measure a cache")
    for r in by.values():
        if "error" in r:
            lines.append(f"{r['run']} ({r['label']}) did not run: {r['error']}")
        elif r.get("counters"):
            c = r["counters"]
            lines.append(f"{r['run']}: of {c['prompt_tokens']:,.0f} prompt tokens, {c['local_hits']:,.0f} hit vLLM's "
                         f"prefix cache and {c['external_hits']:,.0f} came from the KV connector; "
                         f"{c['preemptions']:.0f} preemptions")
            if c.get("hkvd_in_step_loads"):
                lines.append(f"{r['run']}: {c['hkvd_in_step_loads']:.0f} in-step loads (copied by the engine in the "
                             "step that planned them; every rank counted)")
            if c.get("hkvd_loads"):
                each_ms = c["hkvd_load_seconds"] / c["hkvd_loads"] * 1e3
                lines.append(f"{r['run']}: {c['hkvd_loads']:.0f} loads, {each_ms:.1f} ms each on average from "
                             "submission to the worker reading the reply; "
                             f"{c['hkvd_lookups_deferred']:.0f} lookups deferred a step; "
                             f"{c['hkvd_load_settles_won']:.0f} loads reported a step earlier by waiting "
                             f"{c['hkvd_load_settle_seconds'] * 1e3:.0f} ms in all; "
                             f"{c.get('hkvd_loads_reported_early', 0):.0f} reported by the scheduler before "
                             "any worker")
    return lines


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["run", "turn", "requests x prompt tokens", "hit share", "TTFT p50 ms", "TTFT p99 ms",
               "stream tok/s p50"]
    rows: list[list[Any]] = []
    for r in result.get("runs", []):
        if "error" in r:
            rows.append([r["run"], "-", f"error: {r['error']}", "-", float("nan"), float("nan"), float("nan")])
            continue
        for t in r["turns"]:
            turn = "2+" if t["turn"] == "later" else t["turn"]
            size = f"{t['requests']} x {t['prompt_tokens'] // t['requests']}" if t["turn"] != "later" else \
                f"{t['requests']} (all turns: {r['output_tok_s']:.1f} output tok/s)"
            rows.append([r["run"], turn, size, f"{t['hit_share']:.1%}", t["ttft_ms_p50"], t["ttft_ms_p99"],
                         t["stream_tok_s_p50"]])
    if not rows:
        rows.append(["-", "-", result.get("skipped", "no runs"), "", float("nan"), float("nan"), float("nan")])
    return headers, rows


def notes(result: dict[str, Any]) -> str:
    """Text the report puts under the table: the ratios and the targets."""
    lines = summary(result)
    return "\n".join(f"- {ln}" for ln in lines)


def plot(plt: Any, result: dict[str, Any], out_dir: Path) -> list[str]:
    runs = [r for r in result.get("runs", []) if "error" not in r]
    if not runs:
        return []
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for r in runs:
        ts = [t for t in r["turns"] if t["turn"] != "later"]
        x = [t["turn"] for t in ts]
        p50 = [t["ttft_ms_p50"] for t in ts]
        line, = ax.plot(x, p50, marker="o", label=f"{r['run']} p50")
        ax.plot(x, [t["ttft_ms_p99"] for t in ts], marker="x", linestyle=":", color=line.get_color(),
                label=f"{r['run']} p99")
        bx.plot(x, [t["hit_share"] * 100 for t in ts], marker="o", color=line.get_color(), label=r["run"])
    cfg = result.get("config", {})
    ax.set_title(f"TTFT by turn ({cfg.get('model', '?')})")
    ax.set_xlabel("turn")
    ax.set_ylabel("ms")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    bx.set_title("prompt tokens not computed (hit share)")
    bx.set_xlabel("turn")
    bx.set_ylabel("%")
    bx.set_ylim(0, 100)
    bx.legend(fontsize=7)
    for a in (ax, bx):
        a.set_xticks(sorted({t["turn"] for r in runs for t in r["turns"] if t["turn"] != "later"}))
    path = out_dir / "serving.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]
