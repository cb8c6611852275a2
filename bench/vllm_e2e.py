"""vllm_e2e: real vLLM (CPU) with hkvd, cold vs warm, on the tiny hybrid models of tests/shim.

For each model (``qwen3_next``: 3 Gated-DeltaNet + 1 full-attention layer; ``gemma3``: 3
sliding-window + 1 full-attention layer; built offline from fixed seeds by
``tests/shim/tiny_models.py``), with a real ``hkvd serve --chunk-size 128`` (128 = vLLM's block
size N for both on CPU):

- **vLLM alone** (full mode only): an engine without a KV connector, the reference for what the
  connector costs on a miss;
- **cold**: a fresh engine process with ``HkvdConnector``, hkvd empty: every prompt is computed
  and stored;
- **warm**: another fresh engine process (vLLM's prefix cache starts empty, and is reset before
  every prompt): every cached token is served by hkvd.

Each engine runs ``bench.vllm_engine`` in its own process with the same thread binding
(``VLLM_CPU_OMP_THREADS_BIND``, all usable CPUs) and the same settings (prefix caching,
``max_num_batched_tokens`` = 128, one block per step). Prompts: distinct token sequences of 900
tokens (7 full chunks + 4), 8 of them (3 in quick mode). Reported per run: prefill tokens
computed (prompt - cached), tokens served from hkvd and their share of the prompt tokens, time
to first token (``generate`` with ``max_tokens=1``, wall clock; median over the samples: each
prompt once cold, 3 times (2 quick) warm and alone, since a repeat there measures the same
thing), and warm / cold TTFT from the same run. The first sampled token of warm and cold must
agree (greedy), and a repeat must hit as much as the first pass: a mismatch fails the run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import Daemon, engine_result, median

BLOCK = 128
PROMPT_TOKENS = 900
MODELS = {"qwen3_next": {"retention": True}, "gemma3": {"retention": False}}
ENGINE_TIMEOUT_S = 600.0
ROOT = Path(__file__).resolve().parent.parent


def _prompt(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]  # ids 0..3 are the tiny models' special tokens


def _prompts(count: int) -> list[list[int]]:
    return [_prompt(PROMPT_TOKENS, 7 + 6 * k, 3 + k) for k in range(count)]


def _omp_bind() -> str:
    if os.environ.get("HKVD_BENCH_OMP_BIND"):
        return os.environ["HKVD_BENCH_OMP_BIND"]
    cpus = sorted(os.sched_getaffinity(0))
    return f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))


def _tiny_models() -> Any:
    spec = importlib.util.spec_from_file_location("hkvd_tiny_models", ROOT / "tests" / "shim" / "tiny_models.py")
    if spec is None or spec.loader is None:
        raise RuntimeError("tests/shim/tiny_models.py not found: run from an hkvd checkout")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _engine(args: dict[str, Any], log: Any, what: str) -> dict[str, Any]:
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": _omp_bind(), "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "bench.vllm_engine", json.dumps(args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    res, _ = engine_result(proc, ENGINE_TIMEOUT_S, f"vLLM engine ({what})")
    log(f"    {what}: {time.perf_counter() - t0:.0f} s (engine start {res['startup_s']:.0f} s)")
    return res


def _summary(name: str, res: dict[str, Any], n_prompts: int) -> dict[str, Any]:
    """Token counts from the first pass over the prompts; TTFT median over every pass."""
    rs = res["results"]
    first = rs[:n_prompts]
    for i, r in enumerate(rs[n_prompts:]):
        if r["cached_tokens"] != first[i % n_prompts]["cached_tokens"]:
            raise RuntimeError(f"{name}: prompt {i % n_prompts} hit {r['cached_tokens']} tokens on a repeat, "
                               f"{first[i % n_prompts]['cached_tokens']} the first time")
    prompt = sum(r["prompt_tokens"] for r in first)
    cached = sum(r["cached_tokens"] for r in first)
    return {"run": name, "prompts": n_prompts, "samples": len(rs), "prompt_tokens": prompt, "cached_tokens": cached,
            "prefill_computed": prompt - cached, "hkvd_share": cached / prompt if prompt else float("nan"),
            "ttft_ms_p50": median([r["ttft_s"] for r in rs]) * 1e3, "ttft_ms": [r["ttft_s"] * 1e3 for r in rs],
            "tokens": [r["token"] for r in first], "startup_s": res["startup_s"]}


def run(quick: bool, hugepages: str = "auto", log: Any = print) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        log("  vLLM not installed: make vllm")
        return {"skipped": "vllm not installed (make vllm)", "models": []}
    models = ["qwen3_next"] if quick else list(MODELS)
    prompts = _prompts(3 if quick else 8)
    repeats = 2 if quick else 3  # per prompt, where a repeat measures the same thing (not cold)
    root = Path(os.environ.get("HKVD_TEST_MODELS") or "/tmp/hkvd-models")
    tiny = _tiny_models()
    out: list[dict[str, Any]] = []
    for model in models:
        path = tiny.build(model, root)
        log(f"  {model}: {len(prompts)} prompts x {PROMPT_TOKENS} tokens, chunk {BLOCK}")
        base = {"model": str(path), "prompts": prompts, "block": BLOCK, "warmup_prompt": _prompt(64, 5, 1),
                "retention": MODELS[model]["retention"]}
        runs: list[dict[str, Any]] = []
        with Daemon("--chunk-size", str(BLOCK), pool_gb=0.25, hugepages=hugepages) as daemon:
            # Cold once per prompt (a repeat would hit); warm ``repeats`` times.
            for name, n in (("cold", 1), ("warm", repeats)):
                runs.append(_summary(name, _engine({**base, "socket": daemon.socket_path, "repeats": n}, log, name),
                                     len(prompts)))
        if not quick:  # last, so a slow first engine start (cold file caches) does not land on it
            runs.insert(0, _summary("vLLM alone", _engine({**base, "socket": None, "repeats": repeats}, log,
                                                          "vLLM alone"), len(prompts)))
        by = {r["run"]: r for r in runs}
        cold, warm = by["cold"], by["warm"]
        if cold["tokens"] != warm["tokens"]:
            raise RuntimeError(f"{model}: warm first tokens {warm['tokens']} differ from cold {cold['tokens']}")
        for r in runs:
            r["ttft_vs_cold"] = r["ttft_ms_p50"] / cold["ttft_ms_p50"]
        row = {"model": model, "runs": runs, "warm_vs_cold_ttft": warm["ttft_ms_p50"] / cold["ttft_ms_p50"],
               "hkvd_share_warm": warm["hkvd_share"]}
        out.append(row)
        log(f"  {model}: warm {warm['cached_tokens']}/{warm['prompt_tokens']} prompt tokens from hkvd "
            f"({warm['hkvd_share']:.1%}); prefill computed {cold['prefill_computed']} -> {warm['prefill_computed']}; "
            f"TTFT p50 cold {cold['ttft_ms_p50']:.0f} ms, warm {warm['ttft_ms_p50']:.0f} ms "
            f"(warm/cold {row['warm_vs_cold_ttft']:.2f})"
            + (f", vLLM alone {by['vLLM alone']['ttft_ms_p50']:.0f} ms" if "vLLM alone" in by else ""))
    return {"config": {"block": BLOCK, "prompt_tokens": PROMPT_TOKENS, "prompts": len(prompts),
                       "omp_bind": _omp_bind(), "max_num_batched_tokens": BLOCK}, "models": out}


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["model", "run", "prompts x tokens", "prefill tokens computed", "tokens from hkvd", "share",
               "TTFT p50 ms (samples)", "TTFT / cold"]
    rows: list[list[Any]] = []
    for m in result.get("models", []):
        for r in m["runs"]:
            rows.append([m["model"], r["run"], f"{r['prompts']} x {r['prompt_tokens'] // max(1, r['prompts'])}",
                         r["prefill_computed"], r["cached_tokens"], f"{r['hkvd_share']:.1%}",
                         f"{r['ttft_ms_p50']:.0f} ({r.get('samples', r['prompts'])})", r["ttft_vs_cold"]])
    if not rows:
        rows.append(["-", result.get("skipped", "no runs"), "", "", "", "", float("nan"), float("nan")])
    return headers, rows


def plot(plt: Any, result: dict[str, Any], out_dir: Path) -> list[str]:
    models = result.get("models", [])
    if not models:
        return []
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models, strict=True):
        names = [r["run"] for r in m["runs"]]
        ax.bar(names, [r["ttft_ms_p50"] for r in m["runs"]], color=["grey", "tab:blue", "tab:green"][-len(names):])
        for i, r in enumerate(m["runs"]):
            ax.annotate(f"{r['hkvd_share']:.1%} from hkvd\n{r['prefill_computed']} computed", (i, r["ttft_ms_p50"]),
                        textcoords="offset points", xytext=(0, 4), ha="center", fontsize=8)
        ax.set_title(f"{m['model']}: TTFT p50 (warm/cold {m['warm_vs_cold_ttft']:.2f})")
        ax.set_ylabel("ms")
        ax.set_ylim(top=max(r["ttft_ms_p50"] for r in m["runs"]) * 1.3)
    path = out_dir / "vllm_e2e.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]
