"""load_overlap: a decoding request's inter-token latency while another request's long prefix loads.

Real vLLM (CPU) with hkvd. The model is ``wide_kv`` (tests/shim/tiny_models.py: a dense Llama with
8 layers of 8 KV heads x 128, 32 KiB of KV per token, random weights), so a prefix of 4096 tokens is
a 128 MiB load, longer than several decode steps. One engine (``bench.load_overlap_engine``, in its
own process) runs rounds: it computes and stores a few prefix prompts (4096 + 1 tokens), then request
A decodes one token per step while, every ``GAP`` tokens of A, the next prefix prompt arrives and its
4096 tokens load from hkvd (vLLM's own prefix cache was reset). Each loaded prompt's answer must
equal its answer computed without hkvd (greedy), and every one must hit 4096 tokens: a mismatch fails
the run.

Each of A's inter-token latencies (the time between its consecutive tokens, one per step) falls in
one class, by what ran in its step:

- **no load**: no prefix prompt in the engine: A decodes alone (the reference);
- **load in flight**: a load was submitted in the step or in flight when it began: A's steps from
  the one that submits a load to the one that reads the daemon's reply (a load that blocked the
  step would put its whole copy into one of these);
- **loaded prompt computes**: the rest, mostly the step that computes the loaded prompt's last token
  beside A (attention over its 4096 tokens) and a step waiting for a lookup's reply; reported apart,
  since it is the work hkvd leaves to the engine, not the load.

The figure is p99 (and p50) of the load-in-flight class over the no-load class, from the same run,
interleaved in time so that other tenants of a shared machine weigh on both alike. ``load ms`` is
the time from the end of the step that submitted each load to the end of the step that read its
reply (an upper bound of the copy): what a load that blocked its step would add to one step.

CPU placement: on a machine with more than one usable CPU the daemon is pinned to the last one and
the engine process to the others (every thread of it: vLLM binds only its OpenMP threads, through
``VLLM_CPU_OMP_THREADS_BIND``, and its Python threads would otherwise share the daemon's CPU and
wait behind its copy), so the daemon's copy competes with the forward for memory bandwidth only,
not for a core (``HKVD_BENCH_OMP_BIND`` overrides vLLM's binding, and then nothing is pinned).

Full mode: 5 rounds of 5 prefix prompts (25 loads); ``--quick``: 1 round of 3.
``HKVD_BENCH_RAW=FILE`` writes every step's record (``bench.load_overlap_engine``) to FILE.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Daemon, engine_result, percentile

BLOCK = 128
PREFIX_TOKENS = 4096
GAP = 10  # tokens A decodes alone between two loads
ENGINE_TIMEOUT_S = 1500.0
ROOT = Path(__file__).resolve().parent.parent
CLASSES = ("no load", "load in flight", "loaded prompt computes")


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]  # ids 0..3 are the tiny models' special tokens


def _tiny_models() -> Any:
    spec = importlib.util.spec_from_file_location("hkvd_tiny_models", ROOT / "tests" / "shim" / "tiny_models.py")
    if spec is None or spec.loader is None:
        raise RuntimeError("tests/shim/tiny_models.py not found: run from an hkvd checkout")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def placement() -> tuple[str, int | None]:
    """(vLLM's OpenMP binding, the CPU the daemon is pinned to or None)."""
    if os.environ.get("HKVD_BENCH_OMP_BIND"):
        return os.environ["HKVD_BENCH_OMP_BIND"], None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) == 1:
        return str(cpus[0]), None
    return ",".join(map(str, cpus[:-1])), cpus[-1]


def _pin(pid: int, cpu: int) -> None:
    """Pin every thread of ``pid`` to ``cpu`` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})


def engine_args(model: str, socket: str, rounds: int, per_round: int, prefix_tokens: int = PREFIX_TOKENS,
                gap: int = GAP, answer_tokens: int = 1) -> dict[str, Any]:
    """The engine's arguments: ``rounds`` x ``per_round`` distinct prefix prompts of ``prefix_tokens`` + 1."""
    prompts = [_seq(prefix_tokens + 1, 7 + 2 * k, 3 + k) for k in range(rounds * per_round)]
    return {"model": model, "socket": socket, "decode_prompt": _seq(32, 5, 1),
            "rounds": [prompts[r * per_round:(r + 1) * per_round] for r in range(rounds)],
            # Enough for every prompt of a round: the gap, the load's steps and its compute step.
            "decode_tokens": gap + (gap + 24) * per_round, "prefix_gap": gap, "answer_tokens": answer_tokens,
            "max_model_len": prefix_tokens + 64, "batched": 2048}


def run_engine(args: dict[str, Any], omp_bind: str, log: Any = print, pin: bool = False) -> dict[str, Any]:
    """Run ``bench.load_overlap_engine`` in its own process; its JSON result. ``pin``: the whole
    engine process runs on the CPUs of ``omp_bind`` (a comma-separated list)."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": omp_bind, "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
    if pin:
        env["HKVD_BENCH_ENGINE_CPUS"] = omp_bind
    t0 = time.perf_counter()
    with tempfile.NamedTemporaryFile("w", prefix="hkvd-load-overlap-", suffix=".json", delete=False) as f:
        json.dump(args, f)  # too long for a command line (128 KiB per argument)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "bench.load_overlap_engine", f"@{f.name}"], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        return _collect(proc, t0, log)
    finally:
        os.unlink(f.name)


def _collect(proc: subprocess.Popen[bytes], t0: float, log: Any) -> dict[str, Any]:
    res, text = engine_result(proc, ENGINE_TIMEOUT_S, "vLLM engine")
    log(f"  engine: {time.perf_counter() - t0:.0f} s (start {res['startup_s']:.0f} s)")
    res["log"] = text
    return res


def classify(steps: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """(class, inter-token ms) for each of A's tokens after its first, in one round's steps."""
    return [(what, ms) for what, ms, _ in classified_steps(steps)]


def classified_steps(steps: list[dict[str, Any]]) -> list[tuple[str, float, dict[str, Any]]]:
    """(class, inter-token ms, the step) for each of A's tokens after its first."""
    out: list[tuple[str, float, dict[str, Any]]] = []
    last = None
    for s in steps:
        if not s["a"]:
            continue
        if last is not None:
            if s["busy"] or s["started"]:
                what = CLASSES[1]
            elif s["pending"]:
                what = CLASSES[2]
            else:
                what = CLASSES[0]
            out.append((what, (s["t"] - last) * 1e3, s))
        last = s["t"]
    return out


def load_spans(steps: list[dict[str, Any]]) -> list[tuple[float, int]]:
    """(ms from the end of the submitting step to the end of the step that read the reply, A's steps
    that ran wholly while the load was in flight) per load of a round (one load at a time)."""
    spans: list[tuple[float, int]] = []
    start: float | None = None
    inside = 0
    for s in steps:
        if s["started"]:
            start, inside = s["t"], 0
            if not s["in_flight"]:  # the reply was read in the submitting step itself
                spans.append((0.0, 0))
                start = None
        elif start is not None and s["busy"]:
            if s["in_flight"]:
                inside += 1 if s["a"] else 0
            else:
                spans.append(((s["t"] - start) * 1e3, inside))
                start = None
    return spans


def check(res: dict[str, Any], prefix_tokens: int) -> None:
    """Every loaded prompt hit its whole prefix in hkvd and answered as without it."""
    for r, rnd in enumerate(res["rounds"]):
        for i, p in enumerate(rnd["prefixes"]):
            ref, got = p["reference"], p["loaded"]
            if ref["num_cached_tokens"]:
                raise RuntimeError(f"round {r} prompt {i}: {ref['num_cached_tokens']} tokens cached before it was "
                                   "stored (vLLM's prefix cache was not reset?)")
            if got["num_cached_tokens"] != prefix_tokens:
                raise RuntimeError(f"round {r} prompt {i}: {got['num_cached_tokens']} of {prefix_tokens} prefix "
                                   "tokens from hkvd")
            if got["tokens"] != ref["tokens"]:
                raise RuntimeError(f"round {r} prompt {i}: loaded answer {got['tokens']} != computed {ref['tokens']}")


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    itl: dict[str, list[float]] = {c: [] for c in CLASSES}
    waited: dict[str, list[float]] = {c: [] for c in CLASSES}
    spans: list[tuple[float, int]] = []
    for rnd in res["rounds"]:
        for what, ms, step in classified_steps(rnd["steps"]):
            itl[what].append(ms)
            waited[what].append(float(step.get("runqueue_ms", 0.0)))
        spans += load_spans(rnd["steps"])
    # runqueue: how long the engine's stepping thread waited for a CPU in those steps (schedstat),
    # which shows whether something else (the daemon's copy) took its core.
    rows = [{"class": c, "samples": len(v), "p50_ms": percentile(v, 50), "p99_ms": percentile(v, 99),
             "max_ms": max(v, default=float("nan")), "runqueue_ms_p99": percentile(waited[c], 99)}
            for c, v in itl.items()]
    quiet, loading = rows[0], rows[1]
    return {"rows": rows, "itl_ms": itl,
            "p99_ratio": loading["p99_ms"] / quiet["p99_ms"], "p50_ratio": loading["p50_ms"] / quiet["p50_ms"],
            "loads": len(spans), "load_ms_p50": percentile([ms for ms, _ in spans], 50),
            "steps_inside_load_p50": percentile([float(n) for _, n in spans], 50),
            "loaded_bytes": res["loads"]["loaded_bytes"], "loads_failed": res["loads"]["loads_failed"]}


def run(quick: bool, hugepages: str = "auto", log: Any = print) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        log("  vLLM not installed: make vllm")
        return {"skipped": "vllm not installed (make vllm)", "rows": []}
    rounds, per_round = (1, 3) if quick else (5, 5)
    root = Path(os.environ.get("HKVD_TEST_MODELS") or "/tmp/hkvd-models")
    model = _tiny_models().build("wide_kv", root)
    omp_bind, daemon_cpu = placement()
    log(f"  wide_kv: {rounds} x {per_round} prefixes of {PREFIX_TOKENS} tokens; vLLM on CPUs {omp_bind}, "
        f"daemon on {daemon_cpu if daemon_cpu is not None else 'any CPU'}")
    with Daemon("--chunk-size", str(BLOCK), pool_gb=1.0, hugepages=hugepages) as daemon:
        assert daemon.proc is not None
        if daemon_cpu is not None:
            _pin(daemon.proc.pid, daemon_cpu)
        res = run_engine(engine_args(str(model), daemon.socket_path, rounds, per_round), omp_bind, log,
                         pin=daemon_cpu is not None)
    if os.environ.get("HKVD_BENCH_RAW"):  # every step, hook times included, for a closer look
        Path(os.environ["HKVD_BENCH_RAW"]).write_text(json.dumps(res))
    check(res, PREFIX_TOKENS)
    out = summarize(res)
    log(f"  A's inter-token p99: {out['rows'][1]['p99_ms']:.1f} ms with a load in flight, "
        f"{out['rows'][0]['p99_ms']:.1f} ms without (ratio {out['p99_ratio']:.2f}; p50 ratio {out['p50_ratio']:.2f}); "
        f"{out['loads']} loads of {out['loaded_bytes'] / max(1, out['loads']) / 2**20:.0f} MiB, "
        f"{out['load_ms_p50']:.0f} ms each (p50)")
    return {"config": {"block": BLOCK, "prefix_tokens": PREFIX_TOKENS, "gap": GAP, "rounds": rounds,
                       "per_round": per_round, "omp_bind": omp_bind, "daemon_cpu": daemon_cpu, "model": "wide_kv"},
            **out}


def table(result: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    headers = ["A's steps", "samples", "inter-token p50 ms", "p99 ms", "max ms", "p99 / no load", "p50 / no load",
               "waiting for a CPU, p99 ms"]
    rows: list[list[Any]] = []
    base = result["rows"][0] if result.get("rows") else None
    for r in result.get("rows", []):
        assert base is not None
        rows.append([r["class"], r["samples"], r["p50_ms"], r["p99_ms"], r["max_ms"],
                     r["p99_ms"] / base["p99_ms"], r["p50_ms"] / base["p50_ms"],
                     r.get("runqueue_ms_p99", float("nan"))])
    if rows:
        rows.append([f"loads: {result['loads']} x {result['loaded_bytes'] / max(1, result['loads']) / 2**20:.0f} MiB, "
                     f"in flight {result['load_ms_p50']:.0f} ms (p50)", "", "", "", "", float("nan"), float("nan"), ""])
    else:
        rows.append([result.get("skipped", "no runs"), "", "", "", "", float("nan"), float("nan"), ""])
    return headers, rows


def plot(plt: Any, result: dict[str, Any], out_dir: Path) -> list[str]:
    itl = result.get("itl_ms")
    if not itl:
        return []
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for what, values in itl.items():
        if values:
            xs = sorted(values)
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{what} ({len(xs)})")
    ax.set_xscale("log")
    ax.set_xlabel("A's inter-token latency, ms")
    ax.set_ylabel("fraction of A's tokens")
    ax.set_title(f"load_overlap: p99 with a load / without {result['p99_ratio']:.2f}")
    ax.legend()
    path = out_dir / "load_overlap.png"
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [str(path)]
