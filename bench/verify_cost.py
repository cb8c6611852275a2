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
import os
from pathlib import Path
from typing import Any

from bench import serving
from bench.common import median
from bench.serving import BLOCK, FULL, QUICK, merge_rounds
from bench.serving_client import kv_blocks
from bench.serving_server import MODELS, model_path

FRACTIONS = (0.0, 0.01, 0.1)
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
               "divergences": c.get("hkvd_verify_divergences", 0.0), "loads": c.get("hkvd_loads", 0.0)}
        # Each round's throughput: one stalled round weighs on the pooled figure, less on the median of rounds.
        row["output_tok_s_rounds"] = [x["output_tok_s"] for x in r.get("rounds") or [r]]
        if base is not None:
            b_later = next(t for t in base["turns"] if t["turn"] == "later")
            row["throughput_vs_0"] = r["output_tok_s"] / base["output_tok_s"]
            row["later_ttft_p50_vs_0"] = later["ttft_ms_p50"] / b_later["ttft_ms_p50"]
            row["throughput_median_rounds_vs_0"] = (median(row["output_tok_s_rounds"])
                                                    / median([x["output_tok_s"] for x in base.get("rounds") or [base]]))
        out.append(row)
    return out


def run(quick: bool, hugepages: str = "auto", log: Log = print, model: str | None = None,
        rounds: int | None = None) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        log("  vLLM not installed: make vllm")
        return {"skipped": "vllm not installed (make vllm)", "runs": []}
    workload = QUICK if quick else FULL
    bench_model = MODELS[model or ("qwen3_next" if quick else "qwen3_next_8l")]
    root = Path(os.environ.get("HKVD_TEST_MODELS") or "/tmp/hkvd-models")
    model_dir = model_path(bench_model, root)
    blocks = kv_blocks(workload, BLOCK, bench_model.mamba_groups())
    max_len = min(bench_model.max_len, -(-workload.context_tokens() // 256) * 256)
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
                     "verify_fraction": f})
    result = {"config": {"model": bench_model.name, "block": BLOCK, "workload": dataclasses.asdict(workload),
                         "kv_blocks": blocks["small"], "max_model_len": max_len, "rounds": rounds,
                         "fractions": list(FRACTIONS), "target_throughput_loss_at_0.01": TARGET_THROUGHPUT_LOSS},
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
                        if "throughput_median_rounds_vs_0" in f else ""))
    at = next((f for f in result.get("figures", []) if f["verify_fraction"] == 0.01 and "throughput_vs_0" in f), None)
    if at is not None:
        loss = 1.0 - at["throughput_vs_0"]
        verdict = "met" if loss <= TARGET_THROUGHPUT_LOSS else "MISSED"
        lines.append(f"target: at most {TARGET_THROUGHPUT_LOSS:.0%} throughput loss at 0.01: {loss:+.1%}: {verdict}"
                     + (f" (median of rounds: {1.0 - at['throughput_median_rounds_vs_0']:+.1%})"
                        if "throughput_median_rounds_vs_0" in at else "")
                     + ("; nothing was sampled at 0.01, so the difference is run-to-run noise" if not at["sampled"]
                        else ""))
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
