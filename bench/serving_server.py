"""The server side of ``bench.serving``: the bench models, vLLM's OpenAI server, LMCache's MP server.

Role
    ``model_path`` builds (once, offline, fixed seeds) the model a run serves. ``VllmServer``
    starts ``python -m vllm.entrypoints.openai.api_server`` in its own process (its log in a
    file), waits for ``/health``, reads the KV-cache geometry vLLM logged, and stops it.
    ``LmcacheServer`` does the same for ``lmcache server`` from LMCache's own venv.

Contracts
    Every wait is bounded: a server that exits or is not healthy within ``start_timeout_s``
    raises ``RuntimeError`` with the root cause and the tail of its log. Logs go to a temporary
    folder, removed when the server's ``with`` block ends without an error and kept otherwise.
    ``stop`` sends SIGTERM to the server's process group, then SIGKILL after 30 s, so vLLM's
    engine-core child goes with it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.serving_client import Workload, http_get, kv_blocks
from bench.vllm_e2e import ROOT, _omp_bind, _tiny_models

HOST = "127.0.0.1"
MODEL_NAME = "bench"  # --served-model-name
MAX_NUM_BATCHED_TOKENS = 2048  # vLLM 0.32's default for its OpenAI server on CPU, pinned for every run


@dataclass(frozen=True)
class BenchModel:
    """A random-weight model the serving benches serve, with the KV-cache geometry vLLM 0.32 gives it on CPU.

    ``arch`` ``qwen3_next``: 3 Gated-DeltaNet layers per full-attention layer (3 Mamba groups, 1 attention
    group). ``arch`` ``gemma3``: 3 sliding-window layers (``sliding_window`` tokens) per full-attention
    layer, no Mamba state (3 sliding-window groups, 1 full-attention group). ``block``: vLLM's block size,
    the chunk every run uses (checked against vLLM's log at every server start).
    """

    name: str
    layers: int
    hidden: int
    intermediate: int
    max_len: int
    arch: str = "qwen3_next"
    block: int = 128
    sliding_window: int = 0

    def __post_init__(self) -> None:
        if self.arch not in ("qwen3_next", "gemma3"):
            raise ValueError(f"bench model {self.name}: unknown arch {self.arch!r} (qwen3_next or gemma3)")
        if (self.arch == "gemma3") != (self.sliding_window > 0):
            raise ValueError(f"bench model {self.name}: a sliding window belongs to gemma3 models only "
                             f"(arch {self.arch}, sliding_window {self.sliding_window})")

    def kv_groups(self) -> int:
        """vLLM's KV-cache groups: layers go in sets of the rarer kind's count (3:1 here: 1 attention + 3 others)."""
        return 4

    def mamba_groups(self) -> int:
        return 3 if self.arch == "qwen3_next" else 0

    def window_groups(self) -> int:
        return 3 if self.arch == "gemma3" else 0

    def window_cap(self) -> int | None:
        """Most blocks a request holds in one sliding-window group, as vLLM's admission counts them: the window
        less one token plus one step's tokens (``MAX_NUM_BATCHED_TOKENS``), one more block for a window that
        starts inside a block; ``None`` without sliding windows."""
        if not self.sliding_window:
            return None
        return -(-(self.sliding_window - 1 + MAX_NUM_BATCHED_TOKENS) // self.block) + 1

    def kv_blocks(self, workload: Workload) -> dict[str, int]:
        """``bench.serving_client.kv_blocks`` with this model's block and groups."""
        return kv_blocks(workload, self.block, self.mamba_groups(), self.window_groups(), self.window_cap())

    def chunk_bytes(self, block: int) -> dict[str, int]:
        """Bytes of one ``block``-token chunk as vLLM lays them out (bfloat16): ``attention`` (K and V of
        every attention layer) and ``mamba_state``.

        Qwen3-Next: full-attention layers of 4 KV heads x 128; one state per Gated-DeltaNet layer: the
        convolution's last 3 inputs of 1 key head x 2 + 2 value heads x 128 channels, and the recurrent
        state of 2 value heads x 128 x 128. Gemma3: every layer (sliding or not) 2 KV heads x 32, no state."""
        if self.arch == "gemma3":
            return {"attention": self.layers * block * 2 * 2 * 32 * 2, "mamba_state": 0}
        attention_layers = self.layers // 4
        conv = (2 * 1 * 128 + 2 * 128) * 3 * 2
        recurrent = 2 * 128 * 128 * 2
        return {"attention": attention_layers * block * 2 * 4 * 128 * 2,
                "mamba_state": (self.layers - attention_layers) * (conv + recurrent)}


# ``qwen3_next``: the tiny model of tests/shim (4 layers, hidden 128), used by --quick. ``qwen3_next_8l``:
# 8 layers, hidden 512, MoE experts of 512: about 6x the tiny model's prefill compute, so a
# 1,500-token prefill costs about a second on 2 cores (not a few hundred microseconds of
# scheduling overhead), while the head geometry (4 KV heads x 128, linear heads 1 key / 2 value
# x 128) keeps vLLM's block size at 128 like the tiny model's. ``gemma3``: the tiny Gemma3 of
# tests/shim (3 sliding-window layers of window 192 + 1 full-attention layer, 2 KV heads x 32,
# 2,048 positions): vLLM 0.32 on CPU gives it 4 KV-cache groups of block 128.
MODELS = {
    "qwen3_next": BenchModel("qwen3_next", layers=4, hidden=128, intermediate=256, max_len=2048),
    "qwen3_next_8l": BenchModel("qwen3_next_8l", layers=8, hidden=512, intermediate=1024, max_len=4096),
    # The tiny model's shape with 8,192 positions, for sessions longer than 2,048 tokens on the tiny model.
    "qwen3_next_long": BenchModel("qwen3_next_long", layers=4, hidden=128, intermediate=256, max_len=8192),
    # qwen3_next_8l with 8,192 positions: bench/agents.py's full run (16 sessions x 10 turns reach 8,032 tokens).
    "qwen3_next_8l_long": BenchModel("qwen3_next_8l_long", layers=8, hidden=512, intermediate=1024, max_len=8192),
    "gemma3": BenchModel("gemma3", layers=4, hidden=128, intermediate=256, max_len=2048, arch="gemma3",
                         sliding_window=192),
}


def model_path(model: BenchModel, root: Path) -> Path:
    """Build (once; a ``.complete`` marker makes it idempotent) and return the model's directory."""
    tiny = _tiny_models()
    if model.name in tiny.KINDS:
        built = Path(tiny.build(model.name, root))
        check_config(model, json.loads((built / "config.json").read_text()))
        return built
    out = root / model.name
    if (out / ".complete").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, Qwen3NextConfig

    common = {**tiny._common(), "hidden_size": model.hidden, "intermediate_size": model.intermediate,
              "max_position_embeddings": model.max_len}
    cfg = Qwen3NextConfig(
        **common, num_hidden_layers=model.layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (model.layers // 4),
        num_attention_heads=8, num_key_value_heads=4, head_dim=128, linear_num_key_heads=1,
        linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=model.intermediate // 2,
        shared_expert_intermediate_size=model.intermediate // 2, decoder_sparse_step=1, mlp_only_layers=[])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(tiny.SEED)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    tiny._build_tokenizer(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2,
                                                            "pad_token_id": 3}))
    (out / ".complete").write_text("ok\n")
    return out


def check_config(model: BenchModel, config: dict[str, Any]) -> None:
    """Raise ``RuntimeError`` where a built model's ``config.json`` disagrees with ``model`` (positions, window):
    the KV memory and the max model len are sized from ``model``."""
    want = {"max_position_embeddings": model.max_len, "sliding_window": model.sliding_window or None}
    got = {k: config.get(k) for k in want}
    if got != want:
        raise RuntimeError(f"bench model {model.name}: its config.json has {got}, the bench expects {want}: "
                           "make MODELS in bench/serving_server.py match tests/shim/tiny_models.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


_EXC = re.compile(r"\b([A-Z]\w*(?:Error|Exception): .+)$")


def first_error(log: str) -> str:
    """The root cause in a server log: the first exception named on an ERROR line or ending a traceback.

    A failing vLLM start logs the worker's exception first and the engine's "initialization
    failed" after it; the first one is the cause. Falls back to the last line.
    """
    lines = [ln.rstrip() for ln in log.splitlines() if ln.strip()]
    for ln in lines:
        if " ERROR " in ln or "ERROR:" in ln or _EXC.match(ln.strip()):
            m = _EXC.search(ln)
            if m:
                return m.group(1)[:600]
    return lines[-1][-600:] if lines else "(empty log)"


class _Proc:
    """A server process in its own session and process group, its output in ``log``."""

    def __init__(self, what: str, log: Path) -> None:
        self.what = what
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self, cmd: list[str], env: dict[str, str]) -> None:
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                         start_new_session=True)

    def wait_http(self, port: int, path: str, timeout_s: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.what} exited with rc {self.proc.returncode} while starting: "
                                   f"{first_error(_tail(self.log, 1 << 24))}\n--- log tail ({self.log}) ---\n"
                                   f"{_tail(self.log, 3000)}")
            try:
                status, _ = http_get(HOST, port, path, 2.0)
                if status == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.what} not healthy at {HOST}:{port}{path} within {timeout_s:.0f} s "
                                   f"(log: {self.log})\n{_tail(self.log, 3000)}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        except ProcessLookupError:
            pass


def extra_vllm_args() -> list[str]:
    """``HKVD_BENCH_VLLM_ARGS``: more ``vllm serve`` arguments for every run (e.g. ``--no-async-scheduling``)."""
    return shlex.split(os.environ.get("HKVD_BENCH_VLLM_ARGS", ""))


def extra_daemon_args() -> list[str]:
    """``HKVD_BENCH_DAEMON_ARGS``: more ``hkvd serve`` arguments for the hkvd runs (e.g. ``--verify-tolerance 10``
    to record every comparison's error without quarantining)."""
    return shlex.split(os.environ.get("HKVD_BENCH_DAEMON_ARGS", ""))


class VllmServer:
    """vLLM's OpenAI server on a free loopback port, with the settings every run of the bench shares.

    ``kv_transfer`` is the ``--kv-transfer-config`` (None: vLLM alone); ``blocks`` the
    ``--num-gpu-blocks-override``; ``extra_env`` adds to the environment (LMCache's site-packages),
    ``extra_args`` to the command line (before ``HKVD_BENCH_VLLM_ARGS``). ``mamba_align``: pass
    ``--mamba-cache-mode align`` (Mamba/GDN models; vLLM 0.32 fails the first step of a model
    without Mamba layers that has it: "no mamba layers in the model").
    """

    def __init__(self, model_dir: Path, max_model_len: int, block: int, blocks: int,
                 kv_transfer: dict[str, Any] | None, start_timeout_s: float,
                 extra_env: dict[str, str] | None = None, extra_args: list[str] | None = None,
                 mamba_align: bool = True) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hkvd-bench-vllm-"))
        self.port = free_port()
        self.block = block
        self.blocks = blocks
        self.start_timeout_s = start_timeout_s
        self._p = _Proc("vLLM's OpenAI server", self.dir / "vllm.log")
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
                    "--served-model-name", MODEL_NAME, "--host", HOST, "--port", str(self.port),
                    "--dtype", "bfloat16", "--enforce-eager", "--seed", "0", "--max-model-len", str(max_model_len),
                    "--enable-prefix-caching", *(["--mamba-cache-mode", "align"] if mamba_align else []),
                    "--prefix-cache-retention-interval", str(block), "--num-gpu-blocks-override", str(blocks),
                    "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
                    "--enable-prompt-tokens-details", "--uvicorn-log-level", "warning"]
        if kv_transfer is not None:
            self.cmd += ["--kv-transfer-config", json.dumps(kv_transfer)]
        self.cmd += [*(extra_args or ()), *extra_vllm_args()]
        # The same OpenMP binding in every run: vLLM's automatic binding reserves a core when a
        # KV connector is configured, which would change the thread count between runs.
        self.env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": _omp_bind(), "HF_HUB_OFFLINE": "1",
                    "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
                    "DO_NOT_TRACK": "1", **(extra_env or {})}
        self.startup_s = float("nan")

    @property
    def log(self) -> Path:
        return self._p.log

    @property
    def pid(self) -> int:
        """The server's process id (its engine core runs in a child process)."""
        assert self._p.proc is not None, "the server is not started"
        return self._p.proc.pid

    def __enter__(self) -> VllmServer:
        t0 = time.perf_counter()
        self._p.spawn(self.cmd, self.env)
        try:
            self._p.wait_http(self.port, "/health", self.start_timeout_s)
        except BaseException:
            self._p.stop()
            raise
        self.startup_s = time.perf_counter() - t0
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._p.stop()
        if exc_type is None:  # a failed run keeps its log (the error names the path)
            shutil.rmtree(self.dir, ignore_errors=True)

    def geometry(self) -> dict[str, Any]:
        """What vLLM logged about its KV cache: group block sizes, the scheduler's block, the capacity."""
        text = _tail(self.log, 1 << 22)
        groups = re.search(r"kv cache group sizes \(([\d, ]+)\)", text)
        lcm = re.search(r"kv lcm block sizes (\d+)", text)
        size = re.search(r"KV cache size: ([\d,]+) tokens", text)
        return {"group_block_sizes": [int(x) for x in groups.group(1).split(",") if x.strip()] if groups else None,
                "block": int(lcm.group(1)) if lcm else None,
                "kv_cache_tokens": int(size.group(1).replace(",", "")) if size else None}

    def errors(self, limit: int = 5) -> list[str]:
        """The log's ERROR lines and tracebacks' last lines (a run that served may still have failed stores)."""
        out = [ln.strip()[-400:] for ln in _tail(self.log, 1 << 22).splitlines()
               if " ERROR " in ln or re.match(r"^\w*(Error|Exception):", ln.strip())]
        return out[:limit]


class LmcacheServer:
    """``lmcache server`` (LMCache 0.5.6's MP server) from its own venv, on free loopback ports."""

    def __init__(self, venv: Path, chunk: int, start_timeout_s: float) -> None:
        exe = venv / "bin" / "lmcache"
        if not exe.exists():
            raise RuntimeError(f"no {exe}: install LMCache 0.5.6 into {venv} (make bench-peers)")
        self.dir = Path(tempfile.mkdtemp(prefix="hkvd-bench-lmcache-"))
        self.port, http_port, prom_port = free_port(), free_port(), free_port()
        self.http_port = http_port
        self.start_timeout_s = start_timeout_s
        self._p = _Proc("lmcache server", self.dir / "lmcache.log")
        # --separate-object-groups: LMCache's recipe for Mamba/GDN hybrids (its chunk = vLLM's block).
        self.cmd = [str(exe), "server", "--host", HOST, "--port", str(self.port), "--chunk-size", str(chunk),
                    "--separate-object-groups", "--l1-size-gb", "2", "--eviction-policy", "LRU",
                    "--http-host", HOST, "--http-port", str(http_port), "--prometheus-port", str(prom_port)]
        self.env = {**os.environ, "DO_NOT_TRACK": "1", "LMCACHE_LOG_LEVEL": "WARNING"}

    @property
    def log(self) -> Path:
        return self._p.log

    def __enter__(self) -> LmcacheServer:
        self._p.spawn(self.cmd, self.env)
        try:
            self._p.wait_http(self.http_port, "/healthcheck", self.start_timeout_s)
        except BaseException:
            self._p.stop()
            raise
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._p.stop()
        if exc_type is None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def kv_transfer(self) -> dict[str, Any]:
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": f"tcp://{HOST}", "lmcache.mp.port": self.port,
                                              "lmcache.mp.mq_timeout": 60.0}}

    def errors(self, limit: int = 5) -> list[str]:
        return [ln.strip()[-400:] for ln in _tail(self.log, 1 << 22).splitlines()
                if "ERROR" in ln or re.match(r"^\w*(Error|Exception):", ln.strip())][:limit]


def lmcache_env(venv: Path, into: Path) -> dict[str, str]:
    """Environment that lets vLLM's processes import ``lmcache`` from its own venv (for its connector).

    LMCache's site-packages goes at the **end** of ``sys.path`` (a ``sitecustomize`` on
    ``PYTHONPATH`` appends it), so vLLM's torch, transformers and the rest still come from vLLM's
    venv and only what vLLM's venv lacks comes from LMCache's. Put first (plain ``PYTHONPATH``),
    LMCache's copies of shared packages would replace vLLM's.
    """
    found = sorted((venv / "lib").glob("python3*/site-packages"))
    if not found or not (found[0] / "lmcache").is_dir():
        raise RuntimeError(f"no lmcache package under {venv}/lib: install LMCache 0.5.6 there (make bench-peers)")
    into.mkdir(parents=True, exist_ok=True)
    (into / "sitecustomize.py").write_text(f"import sys\nsys.path.append({str(found[0])!r})\n")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(into), os.environ.get("PYTHONPATH", "")) if p)}
