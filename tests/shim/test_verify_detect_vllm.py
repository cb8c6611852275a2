# SPDX-License-Identifier: Apache-2.0
"""Sampled verification catches a daemon serving wrong entries to real vLLM (CPU), and the quarantine holds.

``hkvd serve`` runs under the wrong-entry test hook (tests/e2e/_wrong_entry.py): every entry it would load
or compare is the previous chunk's, well-formed, so checksums pass it. One engine per model (tiny Qwen3-Next
in align mode, tiny Gemma3 with its sliding-window groups; vLLM's default batched-token budget,
``verify_fraction`` 1, the daemon's ``--quarantine-after 1``) runs two chats (tests/shim/e2e_run.py,
conversation mode), vLLM's local cache emptied before every turn:

1. detect: the first request with an hkvd hit is sampled, computed, and its chunks compared: the shifted
   chunks diverge and each attention group checked (full, and Gemma3's sliding-window ones) is quarantined.
   Every later lookup misses (a hit needs every group), so no later request is sampled and none loads.
2. ``hkvd quarantine --clear all``, then the same chats again: the first turn hits again (sampled, it
   diverges, and the layout is quarantined a second time); the rest miss.
3. reference: the daemon stopped, every turn computed whole.

Checked: the daemon's verify status and the engine's counters show the divergences and the quarantine, the
CLI lists and lifts it, nothing is ever loaded, and the greedy tokens of phases 1 and 2 equal the reference
turn for turn. Under a daemon without the hook, the first assertion fails (no divergence).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from hkvd.daemon.cli import query_status
from hkvd.shim.testing.launcher import DaemonProcess

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

BLOCK = 128
# case -> (model, the attention group kinds a hit is checked in at vLLM's default budget; test_verify_vllm.py)
CASES = {"qwen3_next-align": ("qwen3_next", ["full"]), "gemma3": ("gemma3", ["full", "swa"])}
HOOK = Path(__file__).resolve().parents[1] / "e2e" / "_wrong_entry.py"


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]  # ids 0..3 are special tokens


# Turn order A1 B1 A2 B2 A3 B3: A2 is the first request with an hkvd hit (A1's 4 chunks); B1 shares nothing.
CONVERSATIONS = [
    {"first": _seq(600, 7, 3), "users": [_seq(150, 11, 5), _seq(150, 11, 9)], "max_tokens": 16},
    {"first": _seq(600, 19, 4), "users": [_seq(300, 23, 1), _seq(300, 23, 8)], "max_tokens": 16},
]


def _verify(socket: str, timeout_s: float = 10.0) -> dict:
    """The daemon's ``verify`` status part once two reads 0.5 s apart agree."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        part = query_status(socket, 5.0)["verify"]
        if part == last or time.monotonic() > deadline:
            return dict(part)
        last = part
        time.sleep(0.5)


def _hkvd_cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "hkvd.daemon", *args], capture_output=True, text=True,
                          timeout=30, check=True)
    return done.stdout


@pytest.mark.parametrize("case", list(CASES))
def test_wrong_entries_detected_quarantined_and_lifted(case, tiny_models, outputs, engine_runner, tmp_path) -> None:
    model, kinds = CASES[case]
    sock = str(tmp_path / "hkvd.sock")
    d = DaemonProcess(sock, ["--chunk-size", str(BLOCK), "--l1-size-gb", "0.25", "--quarantine-after", "1"],
                      tmp_path / "hkvd.log", prefix=[sys.executable, str(HOOK)]).start()
    seen: dict[int, dict] = {}
    lifted: list[str] = []

    def on_pause(i: int) -> None:
        seen[i] = _verify(sock)
        if i == 1:  # the detect phase's quarantine, listed and lifted by the CLI
            lifted.append(_hkvd_cli("quarantine", "--socket", sock))
            lifted.append(_hkvd_cli("quarantine", "--socket", sock, "--clear", "all"))
            seen[-1] = _verify(sock)
        else:
            d.stop()

    args = {"model": str(tiny_models[model]), "max_num_batched_tokens": 0, "retention": BLOCK,
            "socket": sock, "conversations": CONVERSATIONS, "ignore_eos": True, "logprobs": 2,
            "vllm_metrics": True, "llm": {"max_model_len": 2048},
            "phases": [{"reset": True}] * 3, "pause_before": [1, 2], "sync_dir": str(tmp_path),
            "extra": {"verify_fraction": 1.0}}
    try:
        res = engine_runner(args, timeout_s=800, on_pause=on_pause)
    finally:
        if d.proc is not None and d.proc.poll() is None:
            d.stop()
    detect, again, computed = res["phases"]
    m1, m2, _ = res["vllm_metrics"]
    print(f"{case} detect:", {k: v for k, v in m1.items() if "verif" in k}, seen[1])
    print(f"{case} after the lift:", {k: v for k, v in m2.items() if "verif" in k}, seen[2])

    # 1. Detected: the one sampled hit (A2) diverged, in the daemon's count and in the engine's.
    rows = [r for r in seen[1]["groups"] if r["divergences"] > 0]
    assert rows, f"no divergence detected: {seen[1]}"
    assert m1["vllm:hkvd_verify_divergences"] > 0, m1
    # Quarantined after the first divergence (--quarantine-after 1): each attention group of the layout.
    # Every attention group checked (Gemma3: one full, three sliding-window) diverged and is quarantined.
    attention = [r for r in seen[1]["groups"] if r["kind"] in kinds]
    assert {r["kind"] for r in rows} == set(kinds) and len(rows) == len(attention), seen[1]
    assert all(r["quarantined"] for r in rows), rows
    assert seen[1]["quarantines"] == len(rows) and seen[1]["lifted"] == 0, seen[1]
    assert all(f"{r['fingerprint']} group {r['group']} ({r['kind']})" in lifted[0] for r in rows), lifted
    # Later lookups missed: B2, A3 and B3 hold stored prefixes, yet only A2 was sampled, and nothing loaded.
    assert m1["vllm:hkvd_verify_sampled"] == 1, m1
    assert m1["vllm:hkvd_loads{ok}"] == 0 and m1["vllm:hkvd_loads{failed}"] == 0, m1
    assert [[t["num_cached_tokens"] for t in conv] for conv in detect] == [[0, 0, 0], [0, 0, 0]]

    # 2. Lifted: nothing quarantined; A1 hits again, is sampled, diverges, and quarantines the layout again.
    assert "lifted:" in lifted[1] and rows[0]["fingerprint"] in lifted[1], lifted
    assert not any(r["quarantined"] for r in seen[-1]["groups"]) and seen[-1]["lifted"] == len(rows), seen[-1]
    assert m2["vllm:hkvd_verify_sampled"] == 2, m2
    assert m2["vllm:hkvd_verify_divergences"] > m1["vllm:hkvd_verify_divergences"], (m1, m2)
    assert seen[2]["quarantines"] == 2 * len(rows), seen[2]
    # (Qwen3-Next's A1 ends at its hit's boundary, so its Mamba state may be checked too: the hook has no earlier
    # state to serve for it, as the engine stores none at the default budget, so it matches.)
    assert all(r["quarantined"] for r in seen[2]["groups"] if r["kind"] in kinds), seen[2]
    assert m2["vllm:hkvd_loads{ok}"] == 0, m2

    # 3. Every answer is the engine's own: the greedy tokens of a run computing every turn without hkvd.
    assert [[t["num_cached_tokens"] for t in conv] for conv in computed] == [[0, 0, 0], [0, 0, 0]]
    deltas = [outputs.compare(ref, got, f"phase {p} conversation {c} turn {t + 1}")
              for p, phase in enumerate((detect, again), 1)
              for c, (conv_got, conv_ref) in enumerate(zip(phase, computed, strict=True))
              for t, (got, ref) in enumerate(zip(conv_got, conv_ref, strict=True))]
    print(f"{case}: max logprob delta {max(deltas):.5f}")
