"""``python -m bench {store_retrieve,control_plane,scale,vllm_e2e,load_overlap,usable_prefix,...,serving,all} [--quick]
[--out DIR]``.

``python -m bench report [--write]`` renders docs/benchmarks.md's tables from bench/results/*.json.

Writes ``<out>/<name>.json`` per run and PNG plots when matplotlib is importable, and prints a
markdown table of every run last. ``--quick`` (CI smoke) takes under 2 minutes on 2 cores: ``all
--quick`` leaves out ``vllm_e2e`` and ``load_overlap`` (each vLLM engine takes ~40 s to start);
full ``all`` runs them where vLLM is installed. ``serving`` runs only when named (four vLLM servers
one after another); ``serving --quick`` runs it on the tiny model with a smaller workload. ``verify_cost``
(sampled verification's cost: three vLLM + hkvd servers per round) also runs only when named, and takes
``--serving-model`` and ``--rounds`` too. ``agents`` (agent sessions pausing between turns: vLLM
alone, hkvd with LRU only, hkvd with session pins) runs only when named (``--rounds``, ``--in-step-loads``,
``--sessions-only`` for the sessions without the one-shot stream), and so does ``long_context`` (a hit's
TTFT on prompts of 8K-32K tokens against vLLM's own hit and against recompute). ``eviction`` (in-process: each
eviction policy and admission on a mixed trace of agent sessions and one-shot prompts, the recompute each saves
against lru's at the same pool size) takes about a minute and a half, a few seconds with ``--quick``. ``reasoning``
(a reasoning model's chats: the bytes stored with ``store_decode`` "auto" against storing everything, two engines
per round, ``--rounds``) runs only when named.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import report
from bench.common import git_commit, machine, try_pyplot, write_json

RUNS = ("store_retrieve", "control_plane", "scale", "vllm_e2e", "peer_pull", "prefault", "backings", "cluster",
        "load_overlap", "usable_prefix", "serving", "verify_cost", "agents", "long_context", "eviction", "reasoning")
# Not in `all --quick`: too slow for the 2-minute smoke.
QUICK_SKIPS = ("vllm_e2e", "backings", "cluster", "load_overlap")
# Not in `all`: vLLM servers one after another (serving, agents: four, verify_cost: three), tens of minutes on
# 2 cores.
ALONE = ("serving", "verify_cost", "agents", "long_context", "reasoning")
LMCACHE_VENV = ".bench-lmcache"  # made by `make bench-peers`


def _gpu(quick: bool) -> int:
    """The GPU engine's store_retrieve: the copy engine alone (bench/gpu_copy.py), then through a whole
    ``hkvd serve --copy-engine cuda`` (bench/gpu_store_retrieve.py). Each exits 0 with the reason
    where CuPy or a GPU is missing (1 with HKVD_REQUIRE_GPU=1)."""
    from bench import gpu_copy, gpu_store_retrieve

    rc = int(gpu_copy.main(["--total-mib", "256", "--iters", "3"] if quick else []) or 0)
    quick_args = ["--page-kib", "2048,8192", "--batches", "1,64", "--reps", "5"]
    return rc or int(gpu_store_retrieve.main(quick_args if quick else []) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["report"]:  # docs/benchmarks.md's tables from bench/results/*.json (bench/report.py)
        return report.main(argv[1:])
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", choices=[*RUNS, "all", "gpu_copy"])
    ap.add_argument("--quick", action="store_true", help="CI smoke: fewer sizes and repeats (< 2 min)")
    ap.add_argument("--out", default="bench/results", help="folder for <name>.json and PNG plots")
    ap.add_argument("--hugepages", choices=["auto", "off"], default="auto",
                    help="pool backing for the daemon and the references (default auto)")
    ap.add_argument("--engine", choices=["host", "cuda"], default="host",
                    help="store_retrieve copy engine; cuda runs bench/gpu_copy.py where present")
    ap.add_argument("--lmcache-venv", default=None,
                    help="venv with lmcache 0.5.6 installed (make bench-peers): adds LMCache's ping and lookup to "
                         "control_plane and the LMCache run to serving; default: "
                         f"{LMCACHE_VENV} when it exists and --quick is not given")
    ap.add_argument("--serving-model", choices=["qwen3_next", "qwen3_next_8l", "gemma3"], default=None,
                    help="serving's model (default qwen3_next_8l, the tiny qwen3_next with --quick; gemma3: the "
                         "tiny Gemma3, sliding windows, quick workload only)")
    ap.add_argument("--rounds", "--serving-rounds", dest="rounds", type=int, default=None,
                    help="serving, verify_cost, agents and reasoning: rounds of runs in the same order, each run's "
                         "figures pooled over them and its ratios given round by round (default: serving 3, "
                         "verify_cost 2, agents 1, reasoning 3; 1 with --quick)")
    ap.add_argument("--in-step-loads", action="store_true",
                    help="long_context, agents and serving: hkvd's engine loads hits in the step that plans them "
                         "(in_step_loads); the result is written as <bench>_in_step.json")
    ap.add_argument("--sessions-only", action="store_true",
                    help="agents: the sessions without the one-shot stream (their TTFT without other traffic); "
                         "the result is written as agents_sessions_only[_in_step].json")
    ap.add_argument("--runs", default=None,
                    help="serving and agents: the runs to make, comma-separated (default all; e.g. "
                         "limit,hkvd_pins), in the bench's own order")
    a = ap.parse_args(argv)
    if a.run == "gpu_copy" or (a.engine == "cuda" and a.run == "store_retrieve"):
        return _gpu(a.quick)
    out = Path(a.out)
    runs = (tuple(r for r in RUNS if r not in ALONE and not (a.quick and r in QUICK_SKIPS)) if a.run == "all"
            else (a.run,))
    plt = try_pyplot()
    tables: list[str] = []
    started = time.perf_counter()
    for name in runs:
        mod = importlib.import_module(f"bench.{name}")
        print(f"== {name}{' (quick)' if a.quick else ''}", flush=True)
        t0 = time.perf_counter()
        kwargs: dict[str, Any] = {"quick": a.quick, "hugepages": a.hugepages}
        if name in ("control_plane", "serving"):
            venv = Path(__file__).resolve().parent.parent / LMCACHE_VENV
            auto = None if a.quick or not (venv / "bin" / "python").exists() else str(venv)
            kwargs["lmcache_venv"] = a.lmcache_venv or auto
        if name in ("serving", "verify_cost"):
            kwargs["model"] = a.serving_model
        if name in ("serving", "verify_cost", "agents", "reasoning"):
            kwargs["rounds"] = a.rounds
        if name in ("long_context", "agents", "serving") and a.in_step_loads:
            kwargs["in_step_loads"] = True
        if name in ("serving", "agents") and a.runs:
            kwargs["runs"] = [r.strip() for r in a.runs.split(",") if r.strip()]
        if name == "agents" and a.sessions_only:
            kwargs["sessions_only"] = True
        result = mod.run(**kwargs)
        bench_name = name
        if kwargs.get("sessions_only"):
            name = f"{name}_sessions_only"
        if kwargs.get("in_step_loads"):
            name = f"{name}_in_step"
        payload = {"name": name, "bench": bench_name, "quick": a.quick,
                   "date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": git_commit(),
                   "machine": machine(), "wall_s": time.perf_counter() - t0, **result}
        path = write_json(out, name, payload)
        print(f"  wrote {path} ({payload['wall_s']:.1f} s)")
        if plt is not None:
            for p in mod.plot(plt, result, out):
                print(f"  wrote {p}")
        tables.append(f"### {name}\n\n{report.body(mod, result)}")
    if plt is None:
        print("matplotlib not installed: plots skipped (pip install matplotlib to get PNGs)")
    print(f"\n## hkvd bench{' --quick' if a.quick else ''} ({time.perf_counter() - started:.0f} s; ratios are "
          "same-run, same-buffer; absolute numbers vary 2-3x on shared machines)\n")
    print("\n\n".join(tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
