"""agents: agent sessions that pause between turns, more of them paused than the hkvd pool holds.

Workload (``bench.agents_client.Agents``): 16 sessions (6 in quick mode) of 10 turns (4), 4 (2)
in flight at a time, on ``qwen3_next_long`` (the tiny Qwen3-Next of tests/shim with 8,192
positions). Turn 1 sends a system prompt shared by every session (384 tokens; 256) and a task of
its own (128); every later turn sends the session so far, the model's answer (32 tokens, greedy,
``ignore_eos``) and a tool result of 100 to 800 tokens. After each turn a session pauses for an
exponential time (mean 4 s, at most 20 s; quick: 3 s, 15 s), so that most sessions are paused at
any moment: more than the hkvd pool holds (``pool_sessions``: 6; quick: 2, each of the sessions'
mean size). Lengths and pauses come from a seed: every run sends the same prompts after the same
pauses.

Runs, one after another in one invocation, each a fresh server (and daemon) with the serving
bench's flags (``bench.serving_server.VllmServer``: prefix caching, Mamba align mode, vLLM's
default 2,048 batched tokens, the same OpenMP binding):

1. ``limit``: vLLM alone with ample KV memory (every session twice over): the best a cache can do;
2. ``recompute``: vLLM alone with small KV memory (the sessions in flight and a quarter more):
   a paused session is evicted before it comes back and computed again;
3. ``hkvd_lru``: the small memory with ``HkvdConnector`` and ``hkvd serve`` whose pool holds
   ``pool_sessions`` sessions (``--l1-size-gb`` from the model's bytes per chunk): eviction by
   recency alone;
4. ``hkvd_pins``: the same, every request carrying ``kv_transfer_params`` ``{"hkvd": {"pin_s":
   600, "session": "agent-N"}}`` (pinned longer than any pause), and ``--prefix-match-unit 32``
   given to vLLM; where vLLM refuses to start with it, the run goes on without it and the config
   records why.

Reported per run and turn: hit share (prompt tokens not computed, from each reply's
``cached_tokens``), TTFT p50 and p99 (client side, streaming); per hkvd run the pool's evictions
and, sampled every half second from ``hkvd status`` over the control socket, the pool's used
bytes and the pinned bytes (``null`` where the daemon does not report them); per run the
sessions between turns (time-weighted mean and peak). Targets, ratios from one invocation, turns
2 and on pooled: hkvd_pins' hit share at least 0.95 of the limit's where hkvd_lru's falls below
that, and hkvd_pins' TTFT p50 at most 0.5 of recompute's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import serving
from bench.agents_client import Agents, between_turns, play
from bench.common import Daemon, MiB
from bench.serving_client import Reply, block_budget, cached_tokens, http_get, parse_metrics, stream_completion
from bench.serving_server import HOST, MAX_NUM_BATCHED_TOKENS, MODEL_NAME, MODELS, BenchModel, VllmServer, model_path

BLOCK = serving.BLOCK
MODEL = "qwen3_next_long"
FULL = Agents(sessions=16, concurrency=4, turns=10, system_tokens=384, task_tokens=128, answer_tokens=32,
              pause_mean_s=4.0, pause_max_s=20.0, pool_sessions=6)
QUICK = Agents(sessions=6, concurrency=2, turns=4, system_tokens=256, task_tokens=128, answer_tokens=32,
               pause_mean_s=3.0, pause_max_s=15.0, pool_sessions=2)
RUNS = {
    "limit": "vLLM alone, ample KV memory",
    "recompute": "vLLM alone, small KV memory",
    "hkvd_lru": "vLLM + hkvd, small KV memory, LRU only",
    "hkvd_pins": "vLLM + hkvd, small KV memory, session pins",
}
PIN_S = 600.0  # longer than any pause (pause_max_s) and than a quick run
PREFIX_MATCH_UNIT = 32
TARGETS = {"pins_hits_vs_limit": 0.95, "pins_ttft_vs_recompute": 0.5}  # at least, at most
SAMPLE_S = 0.5
POOL_SLACK_BYTES = 4 * MiB  # two of the pool's 2 MiB superblocks: one per entry size left part-filled
START_TIMEOUT_S = serving.START_TIMEOUT_S
REQUEST_TIMEOUT_S = serving.REQUEST_TIMEOUT_S
Log = Callable[[str], None]


def pool_bytes(agents: Agents, model: BenchModel) -> dict[str, Any]:
    """The hkvd pool of the runs: ``pool_sessions`` sessions of mean size.

    A session of ``mean_context_tokens`` holds that many whole chunks of attention bytes, and one
    state per Gated-DeltaNet layer for each turn it has had (vLLM's align mode keeps a request's
    state where its prompt's last whole block ends, not at every block): the mean session has had
    ``(turns + 1) / 2`` turns.
    """
    per_chunk = model.chunk_bytes(BLOCK)
    mean_chunks = math.floor(agents.mean_context_tokens() / BLOCK)
    session = round(mean_chunks * per_chunk["attention"] + (agents.turns + 1) / 2 * per_chunk["mamba_state"])
    return {**{f"chunk_{k}_bytes": v for k, v in per_chunk.items()},
            "mean_session_chunks": mean_chunks, "mean_session_bytes": session,
            "pool_bytes": agents.pool_sessions * session + POOL_SLACK_BYTES,
            "all_sessions_mean_bytes": agents.sessions * session}


def kv_blocks(agents: Agents, model: BenchModel) -> dict[str, int]:
    """vLLM's small and ample KV memories (``bench.serving_client.block_budget``) for the longest session."""
    longest = max(agents.context_tokens(s) for s in range(agents.sessions))
    return block_budget(math.ceil(longest / BLOCK) + 2 * model.mamba_groups(), agents.sessions, agents.concurrency)


def pool_sample(status: dict[str, Any], t_s: float) -> dict[str, Any]:
    """One point of a daemon's timeline: pool bytes, evictions, and the session pins' bytes, budget and
    sessions (``hkvd status``'s ``pins``; None where the daemon does not report pins)."""
    idx, pool, pins = status.get("index", {}), status.get("pool", {}), status.get("pins") or {}
    return {"t_s": round(t_s, 3), "used_bytes": pool.get("used_bytes"), "total_bytes": pool.get("total_bytes"),
            "evictions": idx.get("evictions"), "stores_dropped": idx.get("stores_dropped"),
            "pinned_bytes": pins.get("pinned_bytes"), "pin_budget_bytes": pins.get("budget_bytes"),
            "pin_sessions": pins.get("sessions")}


class Sampler:
    """``daemon.status()`` every ``SAMPLE_S`` on a thread while a run plays; a failed poll is recorded, not fatal."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.samples: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()  # restart() against a poll that began before it
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="bench-agents-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def restart(self) -> None:
        """Time 0 is now (the first turn): the server's start-up drops out of the timeline."""
        with self._lock:
            self._t0 = time.monotonic()
            self.samples.clear()

    def _loop(self) -> None:
        while not self._stop.is_set():
            t0 = self._t0
            try:
                status = self.daemon.status()
                with self._lock:
                    if t0 == self._t0:  # else restarted meanwhile: this poll is from before time 0
                        self.samples.append(pool_sample(status, time.monotonic() - t0))
            except Exception as e:  # the run goes on; the gap shows in the timeline
                self.errors.append(f"{type(e).__name__}: {e}"[:300])
            self._stop.wait(SAMPLE_S)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10.0)


def _play(server: VllmServer, agents: Agents, pins: bool, log: Log, sampler: Sampler | None) -> dict[str, Any]:
    # One short request first (under a block: nothing to cache) so one-off costs land on no turn.
    stream_completion(HOST, server.port, MODEL_NAME, [5 + (i % 7) for i in range(BLOCK // 2)], 2, REQUEST_TIMEOUT_S)
    before = parse_metrics(http_get(HOST, server.port, "/metrics", 30.0)[1])
    done: dict[int, list[Reply]] = {}
    t0 = time.perf_counter()

    def send(session: int, turn: int, prompt: list[int]) -> Reply:
        start = time.perf_counter() - t0
        extra = {"kv_transfer_params": {"hkvd": {"pin_s": PIN_S, "session": f"agent-{session}"}}} if pins else None
        ttft, e2e, usage, tokens = stream_completion(HOST, server.port, MODEL_NAME, prompt, agents.answer_tokens,
                                                     REQUEST_TIMEOUT_S, extra)
        if usage["prompt_tokens"] != len(prompt):
            raise RuntimeError(f"the server counted {usage['prompt_tokens']} prompt tokens, {len(prompt)} were sent")
        return Reply(session, turn, len(prompt), cached_tokens(usage), int(usage["completion_tokens"]), start, ttft,
                     e2e, tuple(tokens))

    def on_reply(r: Reply) -> None:
        done.setdefault(r.turn, []).append(r)
        if len(done[r.turn]) == agents.sessions:
            st = serving.turn_stats(done[r.turn], agents.turns)[0]
            log(f"    turn {r.turn}: TTFT p50 {st['ttft_ms_p50']:.0f} ms p99 {st['ttft_ms_p99']:.0f} ms, "
                f"hit {st['hit_share']:.1%} ({time.perf_counter() - t0:.0f} s)")

    if sampler is not None:
        sampler.restart()
    replies, spans = play(agents, send, on_reply)
    wall = time.perf_counter() - t0
    after = parse_metrics(http_get(HOST, server.port, "/metrics", 30.0)[1])
    occupancy = between_turns(spans)
    return {"replies": replies, "wall_s": wall, "counters": {k: after[k] - before[k] for k in after},
            "between_turns": occupancy, "errors_logged": server.errors()}


def _one_run(name: str, model_dir: Path, model: BenchModel, max_len: int, agents: Agents, blocks: int,
             pool: int, hugepages: str, log: Log) -> dict[str, Any]:
    """One run in fresh processes; a run that cannot start or serve returns ``{"error": ...}``."""
    base: dict[str, Any] = {"run": name, "label": RUNS[name], "kv_blocks": blocks}
    t0 = time.perf_counter()
    pins = name == "hkvd_pins"

    def serve(kv: dict[str, Any] | None, extra_args: list[str] | None, sampler: Sampler | None) -> dict[str, Any]:
        with VllmServer(model_dir, max_len, BLOCK, blocks, kv, START_TIMEOUT_S, extra_args=extra_args) as server:
            log(f"    server up in {server.startup_s:.0f} s")
            return {**_play(server, agents, pins, log, sampler), "geometry": server.geometry(),
                    "startup_s": server.startup_s}

    try:
        res = _hkvd(serve, pool, hugepages, pins, log) if name.startswith("hkvd") else serve(None, None, None)
    except Exception as e:  # recorded: a run that does not work is a result, and the others go on
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        log(f"    {name} failed after {time.perf_counter() - t0:.0f} s: {msg}")
        return {**base, "error": msg, "error_detail": str(e)[-4000:]}
    replies: list[Reply] = res.pop("replies")
    return {**base, **res, "turns": serving.turn_stats(replies, agents.turns),
            "replies": [r.as_json() for r in replies]}


def _hkvd(serve: Callable[[dict[str, Any] | None, list[str] | None, Sampler | None], dict[str, Any]], pool: int,
          hugepages: str, pins: bool, log: Log) -> dict[str, Any]:
    """An hkvd run: a fresh daemon with a ``pool``-byte pool, sampled while the sessions play.

    The pins run asks vLLM for ``--prefix-match-unit``; a server that does not start with it is
    started again without, and ``prefix_match_unit`` records the error.
    """
    unit: dict[str, Any] = {"asked": PREFIX_MATCH_UNIT if pins else None, "used": None, "error": None}
    attempts = [["--prefix-match-unit", str(PREFIX_MATCH_UNIT)], None] if pins else [None]
    for args in attempts:
        with Daemon("--chunk-size", str(BLOCK), pool_gb=pool / (1 << 30), hugepages=hugepages) as daemon:
            kv = {"kv_connector": "HkvdConnector", "kv_connector_module_path": "hkvd.shim.connector",
                  "kv_role": "kv_both", "kv_connector_extra_config": {"socket_path": daemon.socket_path,
                                                                      "require_daemon": True,
                                                                      "verify_fraction": 0.0}}
            try:
                with Sampler(daemon) as sampler:
                    res = serve(kv, args, sampler)
            except RuntimeError as e:
                if args is None or "not healthy" in str(e) or "exited" not in str(e):
                    raise
                unit["error"] = str(e).splitlines()[0][:600]
                log(f"    vLLM did not start with --prefix-match-unit {PREFIX_MATCH_UNIT}: {unit['error']}; "
                    "again without it")
                continue
            unit["used"] = PREFIX_MATCH_UNIT if args else None
            status = daemon.status()
            res["daemon"] = {k: status["index"].get(k) for k in ("entries", "bytes_stored", "evictions",
                                                                 "stores_dropped")}
            res["daemon"]["by_kind"] = status["index"].get("by_kind")
            res["daemon"]["pool_total_bytes"] = status["pool"].get("total_bytes")
            res["daemon"]["pins"] = status.get("pins")  # None where the daemon has no session pins
            res["pool_timeline"] = sampler.samples
            res["sampler_errors"] = sampler.errors[:5]
            if pins:
                res["prefix_match_unit"] = unit
            return res
    raise AssertionError("unreachable: the last attempt returns or raises")


def _later(run: dict[str, Any]) -> dict[str, Any] | None:
    return next((t for t in run.get("turns", []) if t["turn"] == "later"), None)


def ratios(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Later-turn (2 and on) hit shares against the limit's, TTFT p50 against recompute's and the limit's; targets."""
    later = {r["run"]: lt for r in runs if (lt := _later(r)) is not None}
    out: dict[str, Any] = {"hit_share": {k: v["hit_share"] for k, v in later.items()},
                           "hits_vs_limit": {}, "ttft_p50_vs_recompute": {}, "ttft_p50_vs_limit": {}}
    for name, lt in later.items():
        if "limit" in later and later["limit"]["hit_share"]:
            out["hits_vs_limit"][name] = lt["hit_share"] / later["limit"]["hit_share"]
        for ref in ("recompute", "limit"):
            if ref in later and name != ref:
                out[f"ttft_p50_vs_{ref}"][name] = lt["ttft_ms_p50"] / later[ref]["ttft_ms_p50"]
    targets: dict[str, Any] = {}
    hits = out["hits_vs_limit"]
    bound = TARGETS["pins_hits_vs_limit"]
    targets["pins_hits_vs_limit"] = None if "hkvd_pins" not in hits else {
        "value": hits["hkvd_pins"], "at_least": bound, "met": hits["hkvd_pins"] >= bound}
    # The setting must be one where recency alone loses: hkvd_lru's share below the same bound.
    targets["lru_below_limit"] = None if "hkvd_lru" not in hits else {
        "value": hits["hkvd_lru"], "below": bound, "met": hits["hkvd_lru"] < bound}
    ttft = out["ttft_p50_vs_recompute"].get("hkvd_pins")
    targets["pins_ttft_vs_recompute"] = None if ttft is None else {
        "value": ttft, "at_most": TARGETS["pins_ttft_vs_recompute"], "met": ttft <= TARGETS["pins_ttft_vs_recompute"]}
    out["targets"] = targets
    return out


def run(quick: bool, hugepages: str = "auto", log: Log = print) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        log("  vLLM not installed: make vllm")
        return {"skipped": "vllm not installed (make vllm)", "runs": []}
    agents = QUICK if quick else FULL
    model = MODELS[MODEL]
    if agents.max_context_tokens() > model.max_len:
        raise ValueError(f"sessions may reach {agents.max_context_tokens()} tokens, over {model.name}'s "
                         f"{model.max_len}")
    root = Path(os.environ.get("HKVD_TEST_MODELS") or "/tmp/hkvd-models")
    model_dir = model_path(model, root)
    blocks = kv_blocks(agents, model)
    pool = pool_bytes(agents, model)
    max_len = min(model.max_len, -(-max(agents.context_tokens(s) for s in range(agents.sessions)) // 256) * 256)
    log(f"  {model.name}: {agents.sessions} sessions x {agents.turns} turns, {agents.concurrency} in flight; "
        f"mean session {agents.mean_context_tokens():.0f} tokens; pauses exponential, mean {agents.pause_mean_s} s")
    log(f"  KV blocks: small {blocks['small']}, ample {blocks['ample']}; hkvd pool {pool['pool_bytes'] / MiB:.1f} "
        f"MiB ({agents.pool_sessions} sessions of {pool['mean_session_bytes'] / MiB:.1f} MiB; all "
        f"{pool['all_sessions_mean_bytes'] / MiB:.1f} MiB)")
    runs = []
    for i, name in enumerate(RUNS, 1):
        size = blocks["ample"] if name == "limit" else blocks["small"]
        log(f"  run {i}/{len(RUNS)} {name}: {RUNS[name]} ({size} blocks)")
        runs.append(_one_run(name, model_dir, model, max_len, agents, size, pool["pool_bytes"], hugepages, log))
    result = {"config": {"model": model.name, "block": BLOCK, "agents": dataclasses.asdict(agents),
                         "mean_context_tokens": agents.mean_context_tokens(),
                         "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "kv_blocks": blocks, "pool": pool,
                         "max_model_len": max_len, "pin_s": PIN_S, "prefix_match_unit": PREFIX_MATCH_UNIT,
                         "omp_bind": os.environ.get("HKVD_BENCH_OMP_BIND") or "all usable CPUs"},
              "runs": runs, "ratios": ratios(runs)}
    for line in summary(result):
        log(f"  {line}")
    return result


def _peak(values: Sequence[Any]) -> Any:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def summary(result: dict[str, Any]) -> list[str]:
    """The ratios, the targets and what each run's cache did, one line each."""
    lines: list[str] = []
    cfg = result.get("config") or {}
    rt = result.get("ratios") or {}
    if cfg.get("pool"):
        a, p = cfg["agents"], cfg["pool"]
        lines.append(f"{cfg['model']}: {a['sessions']} sessions x {a['turns']} turns, {a['concurrency']} in flight; "
                     f"hkvd pool {p['pool_bytes'] / MiB:.1f} MiB = {a['pool_sessions']} sessions of mean size "
                     f"({p['mean_session_chunks']} chunks, {p['mean_session_bytes'] / MiB:.1f} MiB) and "
                     f"{POOL_SLACK_BYTES // MiB} MiB; vLLM KV blocks small {cfg['kv_blocks']['small']}, ample "
                     f"{cfg['kv_blocks']['ample']}")
    for name, v in (rt.get("hits_vs_limit") or {}).items():
        if name == "limit":
            continue
        vs_rc = (rt.get("ttft_p50_vs_recompute") or {}).get(name)
        lines.append(f"{name}: later-turn hit share {rt['hit_share'][name]:.1%} = {v:.2f}x the limit's "
                     f"({rt['hit_share']['limit']:.1%})" + (f"; TTFT p50 {vs_rc:.2f}x recompute's" if vs_rc else ""))
    for key, t in (rt.get("targets") or {}).items():
        if t is None:
            lines.append(f"target {key}: not measured (a run it needs failed)")
        elif "at_most" in t:
            lines.append(f"target {key}: {t['value']:.2f} (at most {t['at_most']}): {'met' if t['met'] else 'MISSED'}")
        elif "at_least" in t:
            lines.append(f"target {key}: {t['value']:.2f} (at least {t['at_least']}): "
                         f"{'met' if t['met'] else 'MISSED'}")
        else:
            lines.append(f"{key}: hkvd_lru's later-turn hits {t['value']:.2f}x the limit's, "
                         + ("below" if t["met"] else f"NOT below {t['below']}: this setting does not show what pins "
                            "add"))
    pool_sessions = (cfg.get("agents") or {}).get("pool_sessions")
    for r in result.get("runs", []):
        if "error" in r:
            lines.append(f"{r['run']} ({r['label']}) did not run: {r['error']}")
            continue
        b = r.get("between_turns") or {}
        text = (f"{r['run']}: {b.get('mean', float('nan')):.1f} sessions between turns on average "
                f"(peak {b.get('max')}, pool holds {pool_sessions}), {r['wall_s']:.0f} s")
        if r.get("daemon"):
            d = r["daemon"]
            peak_pin = _peak([s.get("pinned_bytes") for s in r.get("pool_timeline", [])])
            text += (f"; pool: {d['evictions']} evictions, {d['stores_dropped']} stores dropped, "
                     f"{d['entries']} entries at the end; pinned bytes "
                     + ("not reported by the daemon" if peak_pin is None else f"peak {peak_pin / MiB:.1f} MiB")
                     + (f" of {d['pins']['budget_bytes'] / MiB:.1f} MiB allowed, lapsed {d['pins'].get('lapsed')}"
                        if d.get("pins") and r["run"] == "hkvd_pins" else ""))
        c = r.get("counters") or {}
        if c:
            text += (f"; of {c['prompt_tokens']:,.0f} prompt tokens {c['local_hits']:,.0f} hit vLLM's cache, "
                     f"{c['external_hits']:,.0f} the connector's")
            if r["run"] == "hkvd_pins":
                text += (f"; {c.get('hkvd_pins_sent', 0):.0f} requests pinned, {c.get('hkvd_pins_refused', 0):.0f} "
                         "pin asks refused")
        lines.append(text)
        u = r.get("prefix_match_unit")
        if u:
            lines.append(f"{r['run']}: --prefix-match-unit {u['asked']} "
                         + ("used" if u["used"] else f"not used: vLLM did not start with it ({u['error']})"))
        if b and pool_sessions is not None and b.get("mean", 0) <= pool_sessions:
            lines.append(f"{r['run']}: fewer sessions sat between turns than the pool holds: the pauses were short "
                         "against the turns on this machine, so the pool was not under pressure")
    return lines


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["run", "turn", "requests x mean prompt tokens", "hit share", "TTFT p50 ms", "TTFT p99 ms"]
    rows: list[list[Any]] = []
    for r in result.get("runs", []):
        if "error" in r:
            rows.append([r["run"], "-", f"error: {r['error']}", "-", float("nan"), float("nan")])
            continue
        for t in r["turns"]:
            turn = "2+" if t["turn"] == "later" else t["turn"]
            rows.append([r["run"], turn, f"{t['requests']} x {t['prompt_tokens'] // t['requests']}",
                         f"{t['hit_share']:.1%}", t["ttft_ms_p50"], t["ttft_ms_p99"]])
    if not rows:
        rows.append(["-", "-", result.get("skipped", "no runs"), "", float("nan"), float("nan")])
    return headers, rows


def notes(result: dict[str, Any]) -> str:
    return "\n".join(f"- {ln}" for ln in summary(result))


def plot(plt: Any, result: dict[str, Any], out_dir: Path) -> list[str]:
    runs = [r for r in result.get("runs", []) if "error" not in r]
    if not runs:
        return []
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(15, 4))
    for r in runs:
        ts = [t for t in r["turns"] if t["turn"] != "later"]
        x = [t["turn"] for t in ts]
        line, = ax.plot(x, [t["hit_share"] * 100 for t in ts], marker="o", label=r["run"])
        bx.plot(x, [t["ttft_ms_p50"] for t in ts], marker="o", color=line.get_color(), label=f"{r['run']} p50")
        bx.plot(x, [t["ttft_ms_p99"] for t in ts], marker="x", linestyle=":", color=line.get_color(),
                label=f"{r['run']} p99")
        samples = r.get("pool_timeline") or []
        if samples:
            t = [s["t_s"] for s in samples]
            pinned = [(s["pinned_bytes"] or 0) / MiB for s in samples]
            cx.plot(t, pinned, color=line.get_color(), label=f"{r['run']} pinned"
                    + ("" if any(s["pinned_bytes"] is not None for s in samples) else " (not reported)"))
            cx.plot(t, [(s["used_bytes"] or 0) / MiB for s in samples], color=line.get_color(), linestyle=":",
                    label=f"{r['run']} pool used")
    ax.set_title("prompt tokens not computed (hit share)")
    ax.set_xlabel("turn")
    ax.set_ylabel("%")
    ax.set_ylim(0, 100)
    bx.set_title(f"TTFT by turn ({result.get('config', {}).get('model', '?')})")
    bx.set_xlabel("turn")
    bx.set_ylabel("ms")
    bx.set_yscale("log")
    cx.set_title("hkvd pool: pinned bytes over time")
    cx.set_xlabel("s from the first turn")
    cx.set_ylabel("MiB")
    total = next((s["total_bytes"] for r in runs for s in r.get("pool_timeline") or () if s.get("total_bytes")), None)
    if total:  # the daemon's pool, as it reports it (whole superblocks)
        cx.axhline(total / MiB, color="grey", linewidth=0.8, label="pool size")
    turns = sorted({t["turn"] for r in runs for t in r["turns"] if t["turn"] != "later"})
    for a in (ax, bx):
        a.set_xticks(turns)
    for a in (ax, bx, cx):
        a.legend(fontsize=7)
    path = out_dir / "agents.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]
