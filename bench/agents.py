"""agents: agent sessions that pause between turns beside a stream of one-shot requests.

Workload (``bench.agents_client.Agents``): 16 sessions (5 in quick mode) of 10 turns (4), 4 (2)
in flight at a time, on ``qwen3_next_8l_long`` (quick: ``qwen3_next_8l``: 8 layers, hidden 512,
whose prefill is real compute, about a second for 1,500 tokens on 2 cores, so TTFT compares
loading with computing). Turn 1 sends a system prompt shared by every session (384 tokens; 256)
and a task of its own (128); every later turn sends the session so far, the model's answer (32
tokens, greedy, ``ignore_eos``) and a tool result of 100 to 800 tokens. After each turn a session
pauses for an exponential time (mean 60 s, at most 180 s; quick: 10 s, 30 s). Beside the sessions,
one one-shot request at a time (``OneShots``: a unique random prompt of 1,000 to 1,500 tokens, a
2-token answer, never pinned) runs from the first session's start until the last session's last
turn: the node's other traffic, reported apart (count, TTFT) and left out of the sessions' hit
shares and TTFTs. Lengths, prompts and pauses come from a seed: every run sends the same.

Sizes. The engine's small KV memory holds the sessions in flight with a quarter to spare and the
one-shots in flight, far fewer than the sessions paused: a paused session's blocks are taken before
it comes back. The hkvd pool (``pool_plan``) is sized so that its pin budget (``--pin-max-
fraction``, 0.75 here) holds every session's pins at their largest (all of a session's chunks, two
states per turn and its last turn's partial chunks), while the one-shots write more than the pool
between a session's turns (see ``oneshots_to_fill_pool`` in the config against
``oneshots_per_pause`` in each run). The issue's "more sessions are paused than the pool holds" is
read for the engine's memory: for hkvd's pool, a pin budget smaller than the paused sessions cannot
reach the target whatever the policy, because sessions come back roughly in the order they paused,
so the oldest pins, the first to lapse, are those of the session about to return. Pins win where the
budget holds the paused sessions and what a recency-only pool keeps instead is other traffic. The
fraction is 0.75, not the default 0.5: with 0.5 the quick run's pool is 18 one-shots, about as many
as start between a session's turns on 2 cores (17 to 34 in two quick runs), so whether recency alone
loses the sessions would hang on the machine's speed; with 0.75 it is 13.6. The full run's pool is
109 one-shots: its pauses (mean 60 s) are long enough for one stream to write that on 2 cores (about
2 one-shots a second in the quick run).

Runs, one after another in one invocation, each a fresh server (and daemon) with the serving
bench's flags (``bench.serving_server.VllmServer``: prefix caching, Mamba align mode, vLLM's
default 2,048 batched tokens, the same OpenMP binding):

1. ``limit``: vLLM alone with ample KV memory (every session twice over and every one-shot the
   run may send): the best a cache can do;
2. ``recompute``: vLLM alone with the small KV memory: a paused session is evicted before it
   comes back and computed again;
3. ``hkvd_lru``: the small memory with ``HkvdConnector`` and ``hkvd serve`` with the pool above:
   eviction by recency alone;
4. ``hkvd_pins``: the same, every session request carrying ``kv_transfer_params`` ``{"hkvd":
   {"pin_s": 600, "session": "agent-N"}}`` (pinned longer than any pause), and
   ``--prefix-match-unit 32`` given to vLLM; where vLLM refuses to start with it, the run goes on
   without it and the config records why;
5. ``hkvd_turn_ends``: the same pins without ``--prefix-match-unit``: hkvd still resumes each turn at
   the previous turn's end (turn-end states need no finer unit), and vLLM does not end a prefill chunk at
   each prompt's hash-aligned checkpoint, which costs a step per prompt.

``rounds`` (``--rounds``, 1 by default) plays the runs that many times in the same order: each run's figures
pool its rounds and every ratio is also given round by round; a target is met only where every round's ratio
meets it too. ``sessions_only`` (``--sessions-only``) sends no one-shots; ``in_step_loads``
(``--in-step-loads``) has the hkvd runs' engines load hits in the step that plans them.

Reported per run and turn: hit share (prompt tokens not computed, from each reply's
``cached_tokens``), TTFT p50 and p99 (client side, streaming); the one-shots apart; per hkvd run
the pool's evictions and, sampled every half second from ``hkvd status`` over the control socket,
the pool's used bytes and the pinned bytes (``null`` where the daemon does not report them); per
run the sessions between turns (time-weighted mean and peak). Targets, ratios from one
invocation, turns 2 and on pooled, for each pinned run: its hit share at least 0.95 of the limit's
where hkvd_lru's falls below that, and its TTFT p50 at most 0.5 of recompute's.
"""

from __future__ import annotations

import bisect
import dataclasses
import importlib.util
import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench import serving
from bench.agents_client import Agents, OneShots, between_turns, play
from bench.common import Daemon, MiB
from bench.serving_client import Reply, block_budget, http_get, parse_metrics, reply_from_json
from bench.serving_server import HOST, MAX_NUM_BATCHED_TOKENS, MODELS, BenchModel, VllmServer, model_path

BLOCK = serving.BLOCK
MODEL = {"full": "qwen3_next_8l_long", "quick": "qwen3_next_8l"}
# A pin budget of 0.75 of the pool, not the default 0.5: see the module's docstring.
FULL = Agents(sessions=16, concurrency=4, turns=10, system_tokens=384, task_tokens=128, answer_tokens=32,
              pause_mean_s=60.0, pause_max_s=180.0, pin_max_fraction=0.75, oneshot_limit=800)
QUICK = Agents(sessions=5, concurrency=2, turns=4, system_tokens=256, task_tokens=128, answer_tokens=32,
               pause_mean_s=10.0, pause_max_s=30.0, pin_max_fraction=0.75, oneshot_limit=200)
RUNS = {
    "limit": "vLLM alone, ample KV memory",
    "recompute": "vLLM alone, small KV memory",
    "hkvd_lru": "vLLM + hkvd, small KV memory, LRU only",
    "hkvd_pins": "vLLM + hkvd, small KV memory, session pins",
    "hkvd_turn_ends": "vLLM + hkvd, small KV memory, session pins, no --prefix-match-unit",
}
PINNED = ("hkvd_pins", "hkvd_turn_ends")  # runs whose session requests carry pins
UNIT_RUNS = ("hkvd_pins",)  # runs that ask vLLM for --prefix-match-unit
PIN_S = 600.0  # longer than any pause (pause_max_s) and than a quick run
PREFIX_MATCH_UNIT = 32
# at least, at most, at most; each pinned run (the TTFT against the limit's: issue "Hits that pay")
TARGETS = {"hits_vs_limit": 0.95, "ttft_vs_recompute": 0.5, "ttft_vs_limit": 1.10}
SAMPLE_S = 0.5
POOL_SLACK_BYTES = 4 * MiB  # two of the pool's 2 MiB superblocks: one per entry size left part-filled
START_TIMEOUT_S = serving.START_TIMEOUT_S
REQUEST_TIMEOUT_S = serving.REQUEST_TIMEOUT_S
Log = Callable[[str], None]


def session_pin_bytes(agents: Agents, session: int, per_chunk: dict[str, int]) -> int:
    """Bytes ``session``'s pins hold at their largest, after its last turn: every chunk of its tokens
    (a partial last chunk counted whole), two states per turn (the state where a prompt's last
    whole block ends, and the turn-end state), more than a newer pin keeps of its older ones, and the
    attention pages of the last turn's partial chunks (its turn end, and with ``--prefix-match-unit``
    its prompt's checkpoint inside a block)."""
    chunks = math.ceil(agents.context_tokens(session) / BLOCK)
    return (chunks + 2) * per_chunk["attention"] + 2 * agents.turns * per_chunk["mamba_state"]


def oneshot_bytes(agents: Agents, per_chunk: dict[str, int]) -> int:
    """Pool bytes one one-shot request of mean length stores: its chunks and two states."""
    tokens = (agents.oneshot_min + agents.oneshot_max) / 2 + agents.oneshot_answer_tokens
    return math.ceil(tokens / BLOCK) * per_chunk["attention"] + 2 * per_chunk["mamba_state"]


def pool_plan(agents: Agents, model: BenchModel) -> dict[str, Any]:
    """The hkvd pool of the runs: its pin budget (``pin_max_fraction`` of it) holds every session's pins at
    their largest (``session_pin_bytes``, summed), and ``POOL_SLACK_BYTES`` for part-filled superblocks.

    ``oneshots_to_fill_pool``: how many one-shots write as many bytes as the whole pool; a run whose
    one-shots between a session's turns (``oneshots_per_pause``) outnumber it leaves nothing of that
    session to a recency-only pool. ``..._to_fill_unpinned``: the same for the pool outside the budget.
    """
    per_chunk = model.chunk_bytes(BLOCK)
    pins = [session_pin_bytes(agents, s, per_chunk) for s in range(agents.sessions)]
    pool = math.ceil(sum(pins) / agents.pin_max_fraction) + POOL_SLACK_BYTES
    budget = math.floor(agents.pin_max_fraction * pool)
    one = oneshot_bytes(agents, per_chunk)
    return {**{f"chunk_{k}_bytes": v for k, v in per_chunk.items()},
            "session_pins_max_bytes": max(pins), "all_sessions_pins_bytes": sum(pins),
            "pin_max_fraction": agents.pin_max_fraction, "pin_budget_bytes": budget, "pool_bytes": pool,
            "oneshot_mean_bytes": one, "oneshots_to_fill_pool": pool / one,
            "oneshots_to_fill_unpinned": (pool - budget) / one}


def kv_blocks(agents: Agents, model: BenchModel) -> dict[str, int]:
    """vLLM's small and ample KV memories (``bench.serving_client.block_budget``) for the longest session,
    with room for the one-shots: in flight in the small memory, every one the run may send in the ample
    one (so that the limit's own cache never evicts a session for them)."""
    longest = max(agents.context_tokens(s) for s in range(agents.sessions))
    budget = block_budget(math.ceil(longest / BLOCK) + 2 * model.mamba_groups(), agents.sessions,
                          agents.concurrency)
    one = math.ceil((agents.oneshot_max + agents.oneshot_answer_tokens) / BLOCK) + 2 * model.mamba_groups()
    return {**budget, "oneshot": one, "small": budget["small"] + agents.oneshot_in_flight * one,
            "ample": budget["ample"] + agents.oneshot_limit * one}


def short_of_previous(replies: Sequence[Reply]) -> dict[str, int]:
    """Later turns whose hit stopped short of the previous turn's prompt, cut to whole blocks: a cache that
    kept the session's last turn serves at least that (vLLM's own cache does). ``turns``: later turns
    counted; ``short``: those that hit less; ``tokens_short``: the tokens they missed by."""
    by_key = {(r.conv, r.turn): r for r in replies}
    turns = short = missed = 0
    for (conv, turn), r in by_key.items():
        prev = by_key.get((conv, turn - 1))
        if prev is None:
            continue
        turns += 1
        kept = prev.prompt_tokens // BLOCK * BLOCK
        if r.cached_tokens < kept:
            short += 1
            missed += kept - r.cached_tokens
    return {"turns": turns, "short": short, "tokens_short": missed}


def oneshots_per_pause(sessions: Sequence[Reply], oneshots: Sequence[Reply]) -> float:
    """One-shot requests started, on average, between a session's turn and its next (from the end of one
    turn's answer to the next turn's start; ``start_s`` of both from the same clock): what a recency-only
    pool sees written between a session's turns besides the other sessions."""
    by_session: dict[int, list[Reply]] = {}
    for r in sessions:
        by_session.setdefault(r.conv, []).append(r)
    starts = sorted(r.start_s for r in oneshots)
    counts: list[int] = []
    for rs in by_session.values():
        rs.sort(key=lambda r: r.turn)
        for a, b in itertools.pairwise(rs):
            counts.append(bisect.bisect_left(starts, b.start_s) - bisect.bisect_left(starts, a.start_s + a.e2e_s))
    return sum(counts) / len(counts) if counts else 0.0


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
    serving.warm_up(server)
    before = parse_metrics(http_get(HOST, server.port, "/metrics", 30.0)[1])
    done: dict[int, list[Reply]] = {}
    t0 = time.perf_counter()

    def send(session: int, turn: int, prompt: list[int]) -> Reply:
        extra = {"kv_transfer_params": {"hkvd": {"pin_s": PIN_S, "session": f"agent-{session}"}}} if pins else None
        return serving.timed_reply(server, session, turn, prompt, agents.answer_tokens, t0, extra)

    def send_oneshot(i: int, prompt: list[int]) -> Reply:
        return serving.timed_reply(server, i, 1, prompt, agents.oneshot_answer_tokens, t0)

    def on_reply(r: Reply) -> None:
        done.setdefault(r.turn, []).append(r)
        if len(done[r.turn]) == agents.sessions:
            st = serving.turn_stats(done[r.turn], agents.turns)[0]
            log(f"    turn {r.turn}: TTFT p50 {st['ttft_ms_p50']:.0f} ms p99 {st['ttft_ms_p99']:.0f} ms, "
                f"hit {st['hit_share']:.1%} ({time.perf_counter() - t0:.0f} s)")

    if sampler is not None:
        sampler.restart()
    oneshots = OneShots(agents, send_oneshot).start()
    try:
        replies, spans = play(agents, send, on_reply)
    finally:
        background = oneshots.stop(REQUEST_TIMEOUT_S)
    wall = time.perf_counter() - t0
    after = parse_metrics(http_get(HOST, server.port, "/metrics", 30.0)[1])
    occupancy = between_turns(spans)
    return {"replies": replies, "oneshot_replies": background, "oneshots_exhausted": oneshots.exhausted,
            "wall_s": wall, "counters": {k: after[k] - before[k] for k in after},
            "between_turns": occupancy, "errors_logged": server.errors()}


def _one_run(name: str, model_dir: Path, max_len: int, agents: Agents, blocks: int, pool: int, hugepages: str,
             log: Log, in_step: bool = False) -> dict[str, Any]:
    """One run in fresh processes; a run that cannot start or serve returns ``{"error": ...}``."""
    base: dict[str, Any] = {"run": name, "label": RUNS[name], "kv_blocks": blocks}
    t0 = time.perf_counter()
    pins = name in PINNED

    def serve(kv: dict[str, Any] | None, extra_args: list[str] | None, sampler: Sampler | None) -> dict[str, Any]:
        with VllmServer(model_dir, max_len, BLOCK, blocks, kv, START_TIMEOUT_S, extra_args=extra_args) as server:
            log(f"    server up in {server.startup_s:.0f} s")
            return {**_play(server, agents, pins, log, sampler), "geometry": server.geometry(),
                    "startup_s": server.startup_s}

    try:
        res = (_hkvd(serve, pool, agents.pin_max_fraction, hugepages, pins, name in UNIT_RUNS, log, in_step)
               if name.startswith("hkvd")
               else serve(None, None, None))
    except Exception as e:  # recorded: a run that does not work is a result, and the others go on
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        log(f"    {name} failed after {time.perf_counter() - t0:.0f} s: {msg}")
        return {**base, "error": msg, "error_detail": str(e)[-4000:]}
    replies: list[Reply] = res.pop("replies")
    background: list[Reply] = res.pop("oneshot_replies")
    oneshots = oneshot_summary(background, res.pop("oneshots_exhausted"), oneshots_per_pause(replies, background))
    return {**base, **res, "turns": serving.turn_stats(replies, agents.turns), "oneshots": oneshots,
            "short_of_previous": short_of_previous(replies),
            "replies": [r.as_json() for r in replies], "oneshot_replies": [r.as_json() for r in background]}


def oneshot_summary(background: Sequence[Reply], exhausted: bool, per_pause: float) -> dict[str, Any]:
    """The one-shots of a run (or of its rounds pooled): how many, whether the stream ran out, how many
    started between a session's turns on average, and their TTFT and hit share."""
    stats = serving.turn_stats(background, 1)
    return {"count": len(background), "exhausted": exhausted, "per_pause": per_pause,
            **({k: stats[0][k] for k in ("ttft_ms_p50", "ttft_ms_p99", "hit_share")} if stats else {})}


def merge_rounds(played: Sequence[Sequence[dict[str, Any]]], agents: Agents) -> list[dict[str, Any]]:
    """One run per name from its rounds: session and one-shot replies pooled (per-turn figures recomputed over
    them), counters, wall time and turns short of the previous summed, the daemon's figures and pool samples
    from the last round; ``rounds`` keeps each round's own figures. A name whose every round failed keeps its
    first error."""
    out: list[dict[str, Any]] = []
    for name in RUNS:
        tries = [r for rnd in played for r in rnd if r["run"] == name]
        ok = [r for r in tries if "error" not in r]
        if not ok:
            out.extend(tries[:1])
            continue
        replies = [reply_from_json(j) for r in ok for j in r["replies"]]
        background = [reply_from_json(j) for r in ok for j in r["oneshot_replies"]]
        per_pause = [r["oneshots"]["per_pause"] for r in ok]
        short = {k: sum(r["short_of_previous"][k] for r in ok) for k in ok[0]["short_of_previous"]}
        merged = {**ok[-1], "wall_s": sum(r["wall_s"] for r in ok),
                  "counters": {k: sum(r["counters"].get(k, 0.0) for r in ok) for k in ok[0]["counters"]},
                  "errors_logged": [e for r in ok for e in r.get("errors_logged") or ()],
                  "turns": serving.turn_stats(replies, agents.turns), "short_of_previous": short,
                  "oneshots": oneshot_summary(background, any(r["oneshots"]["exhausted"] for r in ok),
                                              sum(per_pause) / len(per_pause)),
                  "replies": [r.as_json() for r in replies], "oneshot_replies": [r.as_json() for r in background]}
        merged["rounds"] = [{k: v for k, v in r.items() if k not in ("replies", "oneshot_replies", "pool_timeline")}
                            for r in ok]
        out.append(merged)
    return out


def _hkvd(serve: Callable[[dict[str, Any] | None, list[str] | None, Sampler | None], dict[str, Any]], pool: int,
          pin_fraction: float, hugepages: str, pins: bool, with_unit: bool, log: Log,
          in_step: bool = False) -> dict[str, Any]:
    """An hkvd run: a fresh daemon with a ``pool``-byte pool and ``--pin-max-fraction pin_fraction``, sampled
    while the sessions play; ``pins``: the session requests carry pins; ``in_step``: the engine loads hits in
    the step that plans them (``in_step_loads``).

    ``with_unit`` asks vLLM for ``--prefix-match-unit``; a server that does not start with it is
    started again without, and ``prefix_match_unit`` records the error.
    """
    unit: dict[str, Any] = {"asked": PREFIX_MATCH_UNIT if with_unit else None, "used": None, "error": None}
    attempts = [["--prefix-match-unit", str(PREFIX_MATCH_UNIT)], None] if with_unit else [None]
    for args in attempts:
        with Daemon("--chunk-size", str(BLOCK), "--pin-max-fraction", str(pin_fraction), pool_gb=pool / (1 << 30),
                    hugepages=hugepages) as daemon:
            kv = {"kv_connector": "HkvdConnector", "kv_connector_module_path": "hkvd.shim.connector",
                  "kv_role": "kv_both", "kv_connector_extra_config": {"socket_path": daemon.socket_path,
                                                                      "require_daemon": True,
                                                                      "verify_fraction": 0.0,
                                                                      **({"in_step_loads": True} if in_step
                                                                         else {})}}
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
            if with_unit:
                res["prefix_match_unit"] = unit
            return res
    raise AssertionError("unreachable: the last attempt returns or raises")


def _later(run: dict[str, Any]) -> dict[str, Any] | None:
    return next((t for t in run.get("turns", []) if t["turn"] == "later"), None)


def ratios(runs: Sequence[dict[str, Any]], rounds: Sequence[Sequence[dict[str, Any]]] = ()) -> dict[str, Any]:
    """Later-turn (2 and on) hit shares against the limit's, TTFT p50 against recompute's and the limit's; targets.

    ``oneshot_ttft_p50_vs_recompute``: the one-shots' TTFT p50 against recompute's run. They are the same
    requests in every run and never hit, so a ratio far from 1 is the machine's load moving between runs,
    not a cache: it bounds how far the sessions' TTFT ratios can be read.

    ``rounds``: the runs of each round, where there were more than one: each target then lists its value
    round by round (``rounds``), and is met only where the pooled value and every round's are (it clears
    the spread).
    """
    later = {r["run"]: lt for r in runs if (lt := _later(r)) is not None}
    out: dict[str, Any] = {"hit_share": {k: v["hit_share"] for k, v in later.items()},
                           "hits_vs_limit": {}, "ttft_p50_vs_recompute": {}, "ttft_p50_vs_limit": {},
                           "oneshot_ttft_p50_vs_recompute": {}}
    oneshot = {r["run"]: r["oneshots"]["ttft_ms_p50"] for r in runs if (r.get("oneshots") or {}).get("ttft_ms_p50")}
    for name, ms in oneshot.items():
        if "recompute" in oneshot and name != "recompute":
            out["oneshot_ttft_p50_vs_recompute"][name] = ms / oneshot["recompute"]
    for name, lt in later.items():
        if "limit" in later and later["limit"]["hit_share"]:
            out["hits_vs_limit"][name] = lt["hit_share"] / later["limit"]["hit_share"]
        for ref in ("recompute", "limit"):
            if ref in later and name != ref:
                out[f"ttft_p50_vs_{ref}"][name] = lt["ttft_ms_p50"] / later[ref]["ttft_ms_p50"]
    targets: dict[str, Any] = {}
    hits = out["hits_vs_limit"]
    bound, most = TARGETS["hits_vs_limit"], TARGETS["ttft_vs_recompute"]
    present = {r["run"] for r in runs}
    for name in PINNED:
        if name not in present and name != "hkvd_pins":
            continue  # a run this invocation did not make (hkvd_pins' targets are always reported)
        short = name.removeprefix("hkvd_")
        targets[f"{short}_hits_vs_limit"] = None if name not in hits else {
            "value": hits[name], "at_least": bound, "met": hits[name] >= bound}
        ttft = out["ttft_p50_vs_recompute"].get(name)
        targets[f"{short}_ttft_vs_recompute"] = None if ttft is None else {
            "value": ttft, "at_most": most, "met": ttft <= most}
        vs_limit = out["ttft_p50_vs_limit"].get(name)
        targets[f"{short}_ttft_vs_limit"] = None if vs_limit is None else {
            "value": vs_limit, "at_most": TARGETS["ttft_vs_limit"], "met": vs_limit <= TARGETS["ttft_vs_limit"]}
    # The setting must be one where recency alone loses: hkvd_lru's share below the same bound.
    targets["lru_below_limit"] = None if "hkvd_lru" not in hits else {
        "value": hits["hkvd_lru"], "below": bound, "met": hits["hkvd_lru"] < bound}
    if len(rounds) > 1:
        serving.clear_spread(targets, [ratios(rnd)["targets"] for rnd in rounds])
    out["targets"] = targets
    return out


def run(quick: bool, hugepages: str = "auto", log: Log = print, rounds: int | None = None,
        in_step_loads: bool = False, sessions_only: bool = False,
        runs: Sequence[str] | None = None) -> dict[str, Any]:
    """The runs (``RUNS``, or those of them named in ``runs``, in ``RUNS``' order), ``rounds`` times in the same
    order (default 1: a full round takes about 70 minutes on 2 cores); ``in_step_loads``: the hkvd runs' engines
    load hits in the step that plans them; ``sessions_only``: no one-shot stream (the sessions' TTFT without
    other traffic)."""
    chosen = serving.pick_runs(RUNS, runs)
    if importlib.util.find_spec("vllm") is None:
        log("  vLLM not installed: make vllm")
        return {"skipped": "vllm not installed (make vllm)", "runs": []}
    if rounds is not None and rounds < 1:
        raise ValueError(f"agents rounds: at least 1, got {rounds}")
    rounds = rounds or 1
    agents = QUICK if quick else FULL
    if sessions_only:
        agents = dataclasses.replace(agents, oneshot_in_flight=0)
    model = MODELS[MODEL["quick" if quick else "full"]]
    if agents.max_context_tokens() > model.max_len:
        raise ValueError(f"sessions may reach {agents.max_context_tokens()} tokens, over {model.name}'s "
                         f"{model.max_len}")
    root = Path(os.environ.get("HKVD_TEST_MODELS") or "/tmp/hkvd-models")
    model_dir = model_path(model, root)
    blocks = kv_blocks(agents, model)
    pool = pool_plan(agents, model)
    longest = max(max(agents.context_tokens(s) for s in range(agents.sessions)),
                  agents.oneshot_max + agents.oneshot_answer_tokens)
    max_len = min(model.max_len, -(-longest // 256) * 256)
    log(f"  {model.name}: {agents.sessions} sessions x {agents.turns} turns, {agents.concurrency} in flight, "
        f"{agents.oneshot_in_flight} one-shot at a time; mean session {agents.mean_context_tokens():.0f} tokens; "
        f"pauses exponential, mean {agents.pause_mean_s} s")
    log(f"  KV blocks: small {blocks['small']}, ample {blocks['ample']}; hkvd pool {pool['pool_bytes'] / MiB:.1f} "
        f"MiB, pin budget {pool['pin_budget_bytes'] / MiB:.1f} MiB ({agents.pin_max_fraction}) for the sessions' "
        f"pins at their largest, {pool['all_sessions_pins_bytes'] / MiB:.1f} MiB; the pool = "
        f"{pool['oneshots_to_fill_pool']:.1f} one-shots")
    played = serving.play_rounds(chosen, rounds, blocks, log, lambda name, size: _one_run(
        name, model_dir, max_len, agents, size, pool["pool_bytes"], hugepages, log, in_step_loads))
    merged = merge_rounds(played, agents)
    result = {"config": {"model": model.name, "block": BLOCK, "agents": dataclasses.asdict(agents),
                         "mean_context_tokens": agents.mean_context_tokens(),
                         "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "kv_blocks": blocks, "pool": pool,
                         "max_model_len": max_len, "pin_s": PIN_S, "prefix_match_unit": PREFIX_MATCH_UNIT,
                         "omp_bind": os.environ.get("HKVD_BENCH_OMP_BIND") or "all usable CPUs",
                         "rounds": rounds, "in_step_loads": in_step_loads, "sessions_only": sessions_only,
                         "runs": list(chosen)},
              "runs": merged, "ratios": ratios(merged, played),
              # each round's later-turn TTFT p50 against its own limit run's
              "round_ratios": [ratios(rnd)["ttft_p50_vs_limit"] for rnd in played]}
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
        lines.append(f"{cfg['model']}: {a['sessions']} sessions x {a['turns']} turns, {a['concurrency']} in flight, "
                     f"{a['oneshot_in_flight']} one-shot at a time; hkvd pool {p['pool_bytes'] / MiB:.1f} MiB, pin "
                     f"budget {p['pin_budget_bytes'] / MiB:.1f} MiB ({p['pin_max_fraction']}) for the sessions' pins "
                     f"at their largest ({p['all_sessions_pins_bytes'] / MiB:.1f} MiB); the pool = "
                     f"{p['oneshots_to_fill_pool']:.1f} one-shots, the rest outside the budget "
                     f"{p['oneshots_to_fill_unpinned']:.1f}; vLLM KV blocks small {cfg['kv_blocks']['small']}, "
                     f"ample {cfg['kv_blocks']['ample']}")
    for name, v in (rt.get("hits_vs_limit") or {}).items():
        if name == "limit":
            continue
        vs_rc = (rt.get("ttft_p50_vs_recompute") or {}).get(name)
        lines.append(f"{name}: later-turn hit share {rt['hit_share'][name]:.1%} = {v:.2f}x the limit's "
                     f"({rt['hit_share']['limit']:.1%})" + (f"; TTFT p50 {vs_rc:.2f}x recompute's" if vs_rc else ""))
    noise = rt.get("oneshot_ttft_p50_vs_recompute") or {}
    if noise:
        lines.append("one-shots' TTFT p50 (the same requests in every run, never hit) against recompute's run: "
                     + ", ".join(f"{k} {v:.2f}x" for k, v in noise.items())
                     + ": how far the machine's load moved between runs")
    for key, t in (rt.get("targets") or {}).items():
        if t is None:
            lines.append(f"target {key}: not measured (a run it needs failed or was not played)")
        elif "at_most" in t or "at_least" in t:
            bound = f"at most {t['at_most']}" if "at_most" in t else f"at least {t['at_least']}"
            each = ("; round by round " + ", ".join("-" if v is None else f"{v:.2f}" for v in t["rounds"])
                    if t.get("rounds") else "")
            lines.append(f"target {key}: {t['value']:.2f} ({bound}{each}): {'met' if t['met'] else 'MISSED'}")
        else:
            lines.append(f"{key}: hkvd_lru's later-turn hits {t['value']:.2f}x the limit's, "
                         + ("below" if t["met"] else f"NOT below {t['below']}: this setting does not show what pins "
                            "add"))
    per_round = result.get("round_ratios") or []
    for name in (rt.get("ttft_p50_vs_limit") or {}) if len(per_round) > 1 else ():
        vals = [r.get(name) for r in per_round]
        if all(v is not None for v in vals):
            lines.append(f"{name}: later-turn TTFT p50 against the limit's, round by round: "
                         + ", ".join(f"{v:.2f}x" for v in vals) + f" (spread {min(vals):.2f}-{max(vals):.2f})")
    fill = (cfg.get("pool") or {}).get("oneshots_to_fill_pool")
    for r in result.get("runs", []):
        if "error" in r:
            lines.append(f"{r['run']} ({r['label']}) did not run: {r['error']}")
            continue
        b = r.get("between_turns") or {}
        o = r.get("oneshots") or {}
        text = (f"{r['run']}: {b.get('mean', float('nan')):.1f} sessions between turns on average "
                f"(peak {b.get('max')}), {r['wall_s']:.0f} s; "
                + ("no one-shots (the sessions alone)" if not o.get("count") else
                   f"{o.get('count')} one-shots"
                   + (" (all the run may send: the stream ran out)" if o.get("exhausted") else "")
                   + f", TTFT p50 {o.get('ttft_ms_p50', float('nan')):.0f} ms, {o.get('per_pause', 0):.1f} "
                   "between a session's turns on average"))
        if r.get("daemon"):
            d = r["daemon"]
            peak_pin = _peak([s.get("pinned_bytes") for s in r.get("pool_timeline", [])])
            text += (f"; pool: {d['evictions']} evictions, {d['stores_dropped']} stores dropped, "
                     f"{d['entries']} entries at the end; pinned bytes "
                     + ("not reported by the daemon" if peak_pin is None else f"peak {peak_pin / MiB:.1f} MiB")
                     + (f" of {d['pins']['budget_bytes'] / MiB:.1f} MiB allowed, lapsed {d['pins'].get('lapsed')}"
                        if d.get("pins") and r["run"] in PINNED else ""))
        c = r.get("counters") or {}
        if c:
            text += (f"; of {c['prompt_tokens']:,.0f} prompt tokens {c['local_hits']:,.0f} hit vLLM's cache, "
                     f"{c['external_hits']:,.0f} the connector's")
            if r["run"].startswith("hkvd"):
                loads = c.get("hkvd_loads", 0)
                text += (f"; {loads:.0f} loads from hkvd, "
                         f"{c.get('hkvd_load_seconds', 0) / loads * 1e3 if loads else 0:.0f} ms each on average, "
                         + (f"{c['hkvd_in_step_loads']:.0f} in-step loads (every rank counted), "
                            if c.get("hkvd_in_step_loads") else "")
                         + f"{c.get('hkvd_lookups_deferred', 0):.0f} lookups deferred a step")
            if r["run"] in PINNED:
                text += (f"; {c.get('hkvd_pins_sent', 0):.0f} requests pinned, {c.get('hkvd_pins_refused', 0):.0f} "
                         "pin asks refused")
        sp = r.get("short_of_previous")
        if sp:
            text += (f"; {sp['short']} of {sp['turns']} later turns hit less than the previous turn's prompt "
                     f"({sp['tokens_short']:,} tokens short)")
        lines.append(text)
        u = r.get("prefix_match_unit")
        if u:
            lines.append(f"{r['run']}: --prefix-match-unit {u['asked']} "
                         + ("used" if u["used"] else f"not used: vLLM did not start with it ({u['error']})"))
        if r["run"] == "hkvd_lru" and fill is not None and o.get("per_pause", 0) < fill:
            lines.append(f"{r['run']}: fewer one-shots between a session's turns ({o.get('per_pause', 0):.1f}) than "
                         f"fill the pool ({fill:.1f}): recency alone may keep a session on this machine")
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
