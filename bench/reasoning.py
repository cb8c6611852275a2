"""reasoning: the bytes a reasoning model's chat stores in hkvd, ``store_decode`` "auto" against storing everything.

A reasoning model writes mostly a thinking part, and its chat template drops an earlier answer's
``<think>...</think>`` from the next turn's prompt: the chunks that fill while it generates can never hit. The
model is the tiny Qwen3-Next (3 Gated-DeltaNet + 1 full-attention layer, align mode, a state kept every block)
with such a template (``qwen3_next_think``, tests/shim/tiny_models.py). Random weights never think, so every
turn's prompt ends with ``<think>`` and the engine's output stands for the thinking part; the next prompt is
built as the template renders it (``bench.reasoning_engine``).

Each round runs the same chats on two engines, each beside a fresh ``hkvd serve`` (chunk 128): **everything**
(``store_decode: true``: the generated chunks are stored too) and **auto** (the default, which reads the
template and stores prompt chunks only), in alternating order from round to round. Per round: the bytes the
daemon holds after the chats (``hkvd status``: ``index.bytes_stored``; the pool never evicts), and the tokens
each turn got from hkvd (vLLM's own prefix cache is reset before each turn). The hits of the two runs must be
equal turn by turn, and their greedy tokens too, or the run fails. The ratio auto / everything of the stored
bytes is printed per round, with the median and the spread (lowest to highest); the issue's target (0.5x at
most, with the same hits) is called met only when the highest round meets it.

Workload: 4 chats of 4 turns, a 512-token first prompt, 384 thinking tokens, a 48-token answer and a 96-token
user message per turn, 3 rounds (``--rounds``); ``--quick``: 2 chats of 3 turns, 192 thinking tokens, 1 round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import Daemon, engine_result, median
from bench.vllm_e2e import BLOCK, ROOT, _omp_bind, _tiny_models

MODEL = "qwen3_next_think"
OPEN = [5, 6]  # the generation prompt's "<think>\n"
TARGET = 0.5  # stored bytes, auto / everything, with the same hits
ENGINE_TIMEOUT_S = 1800.0
MODES = {"everything": True, "auto": "auto"}


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 480 + 20 for i in range(n)]  # ids 0..3 are special tokens; 5, 6 are OPEN


def conversations(count: int, turns: int, thinking: int) -> list[dict[str, Any]]:
    return [{"first": _seq(512, 7 + 4 * k, 3 + k), "users": [_seq(96, 11 + 2 * k, 5 + t) for t in range(turns - 1)],
             "answers": [_seq(48, 13 + k, t + 1) for t in range(turns - 1)], "thinking": thinking}
            for k in range(count)]


def _engine(args: dict[str, Any], log: Any, what: str) -> dict[str, Any]:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": _omp_bind(), "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "bench.reasoning_engine", json.dumps(args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    res, _ = engine_result(proc, ENGINE_TIMEOUT_S, f"vLLM engine ({what})")
    log(f"    {what}: {time.perf_counter() - t0:.0f} s (engine start {res['startup_s']:.0f} s)")
    return res


def _one(mode: str, base: dict[str, Any], hugepages: str, log: Any) -> dict[str, Any]:
    """One engine beside a fresh daemon: its turns and what the daemon holds after them."""
    with Daemon("--chunk-size", str(BLOCK), pool_gb=1.0, hugepages=hugepages) as daemon:
        res = _engine({**base, "socket": daemon.socket_path, "store_decode": MODES[mode]}, log, mode)
        index = daemon.status()["index"]
    if index.get("evictions"):
        raise RuntimeError(f"{mode}: the daemon evicted {index['evictions']} entries; the stored bytes would be "
                           "undercounted (a larger pool is needed)")
    return {"turns": res["turns"], "bytes_stored": int(index["bytes_stored"]), "entries": int(index["entries"]),
            "decode_bytes_not_stored": float(res["decode_bytes_not_stored"])}


def run(quick: bool, hugepages: str = "auto", log: Any = print, rounds: int | None = None) -> dict[str, Any]:
    count, turns, thinking = (2, 3, 192) if quick else (4, 4, 384)
    rounds = rounds or (1 if quick else 3)
    root = Path(os.environ.get("HKVD_TEST_MODELS") or "/tmp/hkvd-models")
    path = _tiny_models().build(MODEL, root)
    convs = conversations(count, turns, thinking)
    base = {"model": str(path), "block": BLOCK, "conversations": convs, "open": OPEN}
    log(f"  {MODEL}: {count} chats x {turns} turns, {thinking} thinking tokens a turn, chunk {BLOCK}, {rounds} "
        f"round(s)")
    out: list[dict[str, Any]] = []
    for r in range(rounds):
        order = list(MODES) if r % 2 == 0 else list(reversed(MODES))
        got = {mode: _one(mode, base, hugepages, log) for mode in order}
        every, auto = got["everything"], got["auto"]
        hits = {m: [[t["cached_tokens"] for t in conv] for conv in g["turns"]] for m, g in got.items()}
        if hits["auto"] != hits["everything"]:
            raise RuntimeError(f"round {r + 1}: auto's hits {hits['auto']} differ from everything's "
                               f"{hits['everything']}")
        same_tokens = all(a["tokens"] == e["tokens"] for ca, ce in zip(auto["turns"], every["turns"], strict=True)
                          for a, e in zip(ca, ce, strict=True))
        if not same_tokens:
            raise RuntimeError(f"round {r + 1}: auto's greedy tokens differ from everything's")
        row = {"round": r + 1, "order": order, "bytes_everything": every["bytes_stored"],
               "bytes_auto": auto["bytes_stored"], "entries_everything": every["entries"],
               "entries_auto": auto["entries"], "ratio": auto["bytes_stored"] / every["bytes_stored"],
               "decode_bytes_not_stored": auto["decode_bytes_not_stored"],
               "hit_tokens": sum(map(sum, hits["auto"])),
               "prompt_tokens": sum(t["prompt_tokens"] for conv in auto["turns"] for t in conv),
               "hits": hits["auto"]}
        out.append(row)
        log(f"  round {r + 1}: stored {row['bytes_auto'] / 2**20:.1f} MiB (auto) vs "
            f"{row['bytes_everything'] / 2**20:.1f} MiB (everything): {row['ratio']:.3f}x; hits "
            f"{row['hit_tokens']} tokens of {row['prompt_tokens']} in both")
    ratios = [r["ratio"] for r in out]
    summary = {"ratio_median": median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
               "target": TARGET, "met": max(ratios) <= TARGET}
    log(f"  auto / everything stored bytes: median {summary['ratio_median']:.3f}x [{summary['ratio_min']:.3f}, "
        f"{summary['ratio_max']:.3f}] over {len(out)} round(s), same hits; target <= {TARGET}x: "
        f"{'met' if summary['met'] else 'not met'}")
    return {"config": {"model": MODEL, "chats": count, "turns": turns, "thinking_tokens": thinking,
                       "first_prompt_tokens": 512, "answer_tokens": 48, "user_tokens": 96, "block": BLOCK,
                       "rounds": rounds, "omp_bind": _omp_bind(),
                       # What a shared machine's load cannot change: bytes and tokens, no times.
                       "figures": "bytes stored and hit tokens only (no times): the machine's load does not change "
                                  "them"},
            "rounds": out, "summary": summary}


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["round", "stored MiB, everything", "stored MiB, auto", "auto / everything", "entries (everything, auto)",
               "hit tokens (both)", "prompt tokens"]
    rows = [[r["round"], round(r["bytes_everything"] / 2**20, 2), round(r["bytes_auto"] / 2**20, 2), r["ratio"],
             f"{r['entries_everything']}, {r['entries_auto']}", r["hit_tokens"], r["prompt_tokens"]]
            for r in result.get("rounds", [])]
    return headers, rows


def notes(result: dict[str, Any]) -> str:
    s, c = result.get("summary"), result.get("config", {})
    if not s:
        return ""
    return (f"{c.get('chats')} chats of {c.get('turns')} turns, {c.get('thinking_tokens')} thinking tokens a turn. "
            f"Stored bytes auto / everything: median {s['ratio_median']:.3f}x, spread [{s['ratio_min']:.3f}, "
            f"{s['ratio_max']:.3f}] over {len(result.get('rounds', []))} round(s), with the same hits and greedy "
            f"tokens turn by turn; target <= {s['target']}x: {'met' if s['met'] else 'not met'} (every round).")


def plot(plt: Any, result: dict[str, Any], out_dir: Path) -> list[str]:
    return []  # the table says it all: two byte counts per round
