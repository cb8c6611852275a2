"""verify_cost: what sampled verification costs a serving engine, at ``verify_fraction`` 0, 0.01 and 0.1.

The serving bench's chat workload (``bench.serving``: its quick workload and tiny ``qwen3_next`` with
``--quick``, else the full one on ``qwen3_next_8l``) against vLLM + hkvd with the small KV memory, once per
fraction, each a fresh server and daemon, in rounds (``rounds``: 1 with ``--quick``, else 2) that take the
fractions in turn. A sampled request with a hit is computed instead of loaded, and its chunks are sent to the
daemon for comparison (docs/verification.md): it costs the prefill of its hit and one copy into the daemon.

Reported per fraction, pooled over the rounds: the run's output tokens/s (every turn), the later turns' (2 and
on) TTFT p50, both as ratios to fraction 0 measured in the same invocation; the requests sampled
(``vllm:hkvd_verify_sampled_total``) and the chunks compared, out of the later-turn requests. The target:
at most 2 % less throughput at 0.01. vLLM's request ids are random, so which hits are sampled differs from
run to run; a small workload at 0.01 may sample none.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from pathlib import Path
from typing import Any

from bench import serving
from bench.common import median
from bench.serving import merge_rounds

FRACTIONS = (0.0, 0.01, 0.1, 1.0)
TARGET_THROUGHPUT_LOSS = 0.02  # at most, at fraction 0.01
Log = serving.Log


def _label(f: float) -> str:
    return f"verify {f:g}"


def _one(fraction: float, *args: Any) -> dict[str, Any]:
    """One hkvd run of the serving bench with ``HKVD_BENCH_VERIFY_FRACTION`` set to ``fraction``."""
    before = os.environ.get("HKVD_BENCH_VERIFY_FRACTION")
    os.environ["HKVD_BENCH_VERIFY_FRACTION"] = repr(fraction)
    try:
        res = serving._one_run("hkvd", *args)
    finally:
        if before is None:
            del os.environ["HKVD_BENCH_VERIFY_FRACTION"]
        else:
            os.environ["HKVD_BENCH_VERIFY_FRACTION"] = before
    return {**res, "verify_fraction": fraction}


def figures(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per fraction: throughput, later-turn TTFT p50, their ratios to fraction 0, what was sampled."""
    base = next((r for r in runs if r.get("verify_fraction") == 0.0 and "error" not in r), None)
    out = []
    for r in runs:
        if "error" in r:
            out.append({"verify_fraction": r["verify_fraction"], "error": r["error"]})
            continue
        later = next(t for t in r["turns"] if t["turn"] == "later")
        c = r["counters"]
        row = {"verify_fraction": r["verify_fraction"], "output_tok_s": r["output_tok_s"],
               "later_ttft_ms_p50": later["ttft_ms_p50"], "later_requests": later["requests"],
               "sampled": c.get("hkvd_verify_sampled", 0.0), "chunks_compared": c.get("hkvd_verify_checks", 0.0),
               "divergences": c.get("hkvd_verify_divergences", 0.0), "loads": c.get("hkvd_loads", 0.0),
               "cpu_s": r.get("cpu_s", math.nan), "tokens_vs_0": r.get("tokens_vs_0")}
        # Each round's throughput: one stalled round weighs on the pooled figure, less on the median of rounds.
        row["output_tok_s_rounds"] = [x["output_tok_s"] for x in r.get("rounds") or [r]]
        if base is not None:
            b_later = next(t for t in base["turns"] if t["turn"] == "later")
            row["throughput_vs_0"] = r["output_tok_s"] / base["output_tok_s"]
            row["later_ttft_p50_vs_0"] = later["ttft_ms_p50"] / b_later["ttft_ms_p50"]
            row["cpu_vs_0"] = row["cpu_s"] / base.get("cpu_s", math.nan)
            row["throughput_median_rounds_vs_0"] = (median(row["output_tok_s_rounds"])
                                                    / median([x["output_tok_s"] for x in base.get("rounds") or [base]]))
        out.append(row)
    every = next((r for r in out if r["verify_fraction"] == 1.0 and "cpu_vs_0" in r), None)
    if every is not None and math.isfinite(every["cpu_vs_0"]):
        for row in out:
            if "error" not in row:
                row["projected_throughput_loss"] = projected_loss(row["verify_fraction"], every["cpu_vs_0"])
    return out


def projected_loss(fraction: float, cpu_every_vs_0: float) -> float:
    """Throughput lost at ``fraction`` when checking every hit costs ``cpu_every_vs_0`` times the CPU of none.

    Each request with a hit is sampled on its own with probability ``fraction`` and costs the same extra
    work (its hit's prefill and one copy into the daemon) whichever others are sampled, so the extra work
    at ``fraction`` is that share of the extra work at 1; a compute-bound server's throughput falls as its
    work per request grows."""
    extra = max(cpu_every_vs_0 - 1.0, 0.0) * fraction
    return 1.0 - 1.0 / (1.0 + extra)


def same_tokens(played: list[list[dict[str, Any]]], fraction: float) -> dict[str, int]:
    """Replies at ``fraction`` whose tokens equal the same round's fraction-0 reply to the same conversation
    and turn, out of those both runs have."""
    equal = compared = 0
    for rnd in played:
        base = next((r for r in rnd if r.get("verify_fraction") == 0.0 and "error" not in r), None)
        mine = next((r for r in rnd if r.get("verify_fraction") == fraction and "error" not in r), None)
        if base is None or mine is None:
            continue
        ref = {(j["conv"], j["turn"]): j["token_ids"] for j in base["replies"]}
        for j in mine["replies"]:
            if (j["conv"], j["turn"]) in ref:
                compared += 1
                equal += list(j["token_ids"]) == list(ref[(j["conv"], j["turn"])])
    return {"equal": equal, "compared": compared}


def run(quick: bool, hugepages: str = "auto", log: Log = print, model: str | None = None,
        rounds: int | None = None) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        log("  vLLM not installed: make vllm")
        return {"skipped": "vllm not installed (make vllm)", "runs": []}
    st = serving.setup(quick, model)
    workload, bench_model, model_dir, blocks, max_len = st.workload, st.model, st.model_dir, st.blocks, st.max_len
    rounds = rounds or (1 if quick else 2)
    played: list[list[dict[str, Any]]] = []
    for rnd in range(1, rounds + 1):
        played.append([])
        for f in FRACTIONS:
            log(f"  round {rnd}/{rounds}: vLLM + hkvd at verify_fraction {f:g} ({blocks['small']} blocks)")
            res = _one(f, model_dir, bench_model, max_len, workload, blocks["small"], hugepages, None, log)
            played[-1].append({**res, "run": _label(f)})
    runs = []
    for f in FRACTIONS:  # serving.merge_rounds pools by serving's run names: pool each fraction as "hkvd"
        mine = [[{**r, "run": "hkvd"} for r in rnd if r["verify_fraction"] == f] for rnd in played]
        merged = merge_rounds(mine, workload.turns)[0] if any(mine) else {"error": "no run"}
        runs.append({**merged, "run": _label(f), "label": f"vLLM + hkvd, verify_fraction {f:g}",
                     "verify_fraction": f, "tokens_vs_0": same_tokens(played, f)})
    result = {"config": {"model": bench_model.name, "block": bench_model.block,
                         "workload": dataclasses.asdict(workload),
                         "kv_blocks": blocks["small"], "max_model_len": max_len, "rounds": rounds,
                         "fractions": list(FRACTIONS), "target_throughput_loss_at_0.01": TARGET_THROUGHPUT_LOSS,
                         "extra_daemon_args": serving.extra_daemon_args()},
              "runs": runs, "figures": figures(runs)}
    for line in summary(result):
        log(f"  {line}")
    return result


def summary(result: dict[str, Any]) -> list[str]:
    lines = []
    for f in result.get("figures", []):
        if "error" in f:
            lines.append(f"verify_fraction {f['verify_fraction']:g}: did not run: {f['error']}")
            continue
        ratio = (f" ({f['throughput_vs_0']:.3f}x fraction 0's), later-turn TTFT p50 {f['later_ttft_ms_p50']:.0f} ms "
                 f"({f['later_ttft_p50_vs_0']:.3f}x)") if "throughput_vs_0" in f else ""
        lines.append(f"verify_fraction {f['verify_fraction']:g}: {f['output_tok_s']:.1f} output tok/s{ratio}; "
                     f"sampled {f['sampled']:.0f} of {f['later_requests']} later-turn requests, "
                     f"{f['chunks_compared']:.0f} chunks compared, {f['divergences']:.0f} divergences, "
                     f"{f['loads']:.0f} loads; output tok/s round by round "
                     + ", ".join(f"{x:.0f}" for x in f.get("output_tok_s_rounds", []))
                     + (f" (median {f['throughput_median_rounds_vs_0']:.3f}x fraction 0's)"
                        if "throughput_median_rounds_vs_0" in f else "")
                     + (f"; server and daemon CPU {f['cpu_s']:.1f} s ({f['cpu_vs_0']:.3f}x fraction 0's)"
                        if math.isfinite(f.get("cpu_vs_0", math.nan)) else "")
                     + (f"; replies token-equal to fraction 0's {f['tokens_vs_0']['equal']} of "
                        f"{f['tokens_vs_0']['compared']}" if f.get("tokens_vs_0") else ""))
    at = next((f for f in result.get("figures", []) if f["verify_fraction"] == 0.01 and "throughput_vs_0" in f), None)
    if at is not None:
        loss = 1.0 - at["throughput_vs_0"]
        verdict = "met" if loss <= TARGET_THROUGHPUT_LOSS else "MISSED"
        lines.append(f"target: at most {TARGET_THROUGHPUT_LOSS:.0%} throughput loss at 0.01: {loss:+.1%}: {verdict}"
                     + (f" (median of rounds: {1.0 - at['throughput_median_rounds_vs_0']:+.1%})"
                        if "throughput_median_rounds_vs_0" in at else "")
                     + ("; nothing was sampled at 0.01, so the difference is run-to-run noise" if not at["sampled"]
                        else ""))
        if "projected_throughput_loss" in at:
            proj = at["projected_throughput_loss"]
            lines.append(f"projected from fraction 1's CPU cost: {proj:+.2%} throughput at 0.01: "
                         + ("met" if proj <= TARGET_THROUGHPUT_LOSS else "MISSED"))
    return lines


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["verify_fraction", "output tok/s", "vs 0", "later TTFT p50 ms", "vs 0", "sampled / later requests",
               "chunks compared"]
    rows: list[list[Any]] = []
    for f in result.get("figures", []):
        if "error" in f:
            rows.append([f"{f['verify_fraction']:g}", f"error: {f['error']}", "", float("nan"), "", "", ""])
            continue
        rows.append([f"{f['verify_fraction']:g}", f["output_tok_s"], f"{f.get('throughput_vs_0', float('nan')):.3f}",
                     f["later_ttft_ms_p50"], f"{f.get('later_ttft_p50_vs_0', float('nan')):.3f}",
                     f"{f['sampled']:.0f} / {f['later_requests']}", f"{f['chunks_compared']:.0f}"])
    if not rows:
        rows.append(["-", result.get("skipped", "no runs"), "", float("nan"), "", "", ""])
    return headers, rows


def notes(result: dict[str, Any]) -> str:
    return "\n".join(f"- {ln}" for ln in summary(result))


def plot(plt: Any, result: dict[str, Any], out_dir: Path) -> list[str]:
    return []
