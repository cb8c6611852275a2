"""bench serving: the workload, the conversation scheduling, per-turn statistics, targets and the report.

Correctness only, no timing assertions. The vLLM server is left out: ``converse`` takes the
function that sends a turn, and these tests pass one that answers from the prompt, so the
scheduling and prompt building are checked without 40 s server starts (``python -m bench
serving --quick`` runs the real thing).
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # bench/ is not an installed package (see tests/unit/test_bench.py)
try:
    from bench import report, serving
    from bench.common import md_table
    from bench.serving_client import Reply, Workload, cached_tokens, converse, kv_blocks, parse_metrics
    from bench.serving_server import MODELS, BenchModel, VllmServer, check_config, first_error
finally:
    sys.path.remove(str(ROOT))

W = Workload(conversations=5, concurrency=2, turns=3, first_tokens=40, user_tokens=10, answer_tokens=4)


def _answer(prompt: list[int], n: int) -> tuple[int, ...]:
    return tuple((sum(prompt) + i) % 500 + 4 for i in range(n))


def test_workload_messages_are_fixed_fresh_and_sized() -> None:
    first = [W.message(c, 1) for c in range(W.conversations)]
    assert [len(m) for m in first] == [40] * 5 and len(W.message(0, 2)) == 10
    assert len({tuple(m) for m in first}) == 5  # every conversation starts differently
    assert W.message(3, 2) == Workload(**W.__dict__).message(3, 2)  # same seed, same ids
    assert W.message(3, 2) != W.message(3, 3)
    assert all(4 <= t < 512 for m in first for t in m)  # no special tokens
    assert [W.prompt_tokens(t) for t in (1, 2, 3)] == [40, 54, 68] and W.context_tokens() == 72
    with pytest.raises(ValueError, match="concurrency 6 exceeds"):
        Workload(conversations=5, concurrency=6, turns=1, first_tokens=1, user_tokens=1, answer_tokens=1)
    with pytest.raises(ValueError, match="turns must be >= 1"):
        Workload(conversations=5, concurrency=1, turns=0, first_tokens=1, user_tokens=1, answer_tokens=1)


def test_kv_blocks_small_holds_the_running_conversations_and_not_all() -> None:
    b = kv_blocks(serving.FULL, 128, 3)
    # 1500 + 3 x (128 + 200) + 128 = 2612 tokens: 21 attention blocks, and 2 per Mamba group.
    assert b == {"per_conversation": 27, "all_conversations": 216, "small": 135, "ample": 432}
    with pytest.raises(ValueError, match=r"more conversations than 1\.25x the concurrency"):
        kv_blocks(Workload(conversations=5, concurrency=4, turns=1, first_tokens=1, user_tokens=1,
                           answer_tokens=1), 128, 3)


def test_kv_blocks_count_every_sliding_window_group_up_to_its_cap() -> None:
    # Quick: 600 + 2 x (32 + 100) + 32 = 896 tokens, 7 blocks of full attention and 7 in each of the 3
    # sliding-window groups (a prompt computed from its first token allocates every block before vLLM frees
    # those behind the window); no Mamba state.
    assert kv_blocks(serving.QUICK, 128, 0, 3) == {"per_conversation": 28, "all_conversations": 112,
                                                   "small": 70, "ample": 224}
    # The cap binds past it: 2612 tokens are 21 blocks, 19 per sliding-window group.
    assert kv_blocks(serving.FULL, 128, 0, 3, 19)["per_conversation"] == 21 + 3 * 19
    assert kv_blocks(serving.FULL, 128, 3, 0, None) == kv_blocks(serving.FULL, 128, 3)


def test_models_carry_their_geometry() -> None:
    gemma = MODELS["gemma3"]
    assert (gemma.block, gemma.kv_groups(), gemma.mamba_groups(), gemma.window_groups()) == (128, 4, 0, 3)
    # vLLM's admission cap for one sliding-window group: (192 - 1 + 2048 batched tokens) / 128, rounded up, + 1.
    assert gemma.window_cap() == 19
    assert gemma.kv_blocks(serving.QUICK) == kv_blocks(serving.QUICK, 128, 0, 3, 19)
    assert gemma.chunk_bytes(128) == {"attention": 128 << 10, "mamba_state": 0}  # 4 layers x 2 KV heads x 32
    for name in ("qwen3_next", "qwen3_next_8l", "qwen3_next_long"):  # Qwen3-Next-shaped: as before
        m = MODELS[name]
        assert (m.block, m.kv_groups(), m.mamba_groups(), m.window_groups(), m.window_cap()) == (128, 4, 3, 0, None)
        assert m.kv_blocks(serving.FULL) == {"per_conversation": 27, "all_conversations": 216, "small": 135,
                                             "ample": 432}
    with pytest.raises(ValueError, match="sliding window belongs to gemma3"):
        BenchModel("x", layers=4, hidden=128, intermediate=256, max_len=2048, arch="gemma3")
    with pytest.raises(ValueError, match="unknown arch 'llama'"):
        BenchModel("x", layers=4, hidden=128, intermediate=256, max_len=2048, arch="llama")


def test_check_config_refuses_a_model_built_other_than_the_bench_expects() -> None:
    check_config(MODELS["gemma3"], {"max_position_embeddings": 2048, "sliding_window": 192})
    check_config(MODELS["qwen3_next"], {"max_position_embeddings": 2048})
    with pytest.raises(RuntimeError, match=r"make MODELS in bench/serving_server\.py match"):
        check_config(MODELS["gemma3"], {"max_position_embeddings": 1024, "sliding_window": 192})
    with pytest.raises(RuntimeError, match="'sliding_window': 512"):
        check_config(MODELS["gemma3"], {"max_position_embeddings": 2048, "sliding_window": 512})


def test_the_mamba_cache_mode_is_asked_for_mamba_models_only(tmp_path: Path) -> None:
    # vLLM 0.32 fails the first step of a model without Mamba layers started with it ("no mamba layers").
    cmds = []
    for align in (True, False):
        server = VllmServer(tmp_path, 1024, 128, 70, None, 1.0, mamba_align=align)
        shutil.rmtree(server.dir)  # nothing started: only the command line is read
        cmds.append([a for a in server.cmd if a != str(server.port)])  # each has its own free port
    assert cmds[0][cmds[0].index("--mamba-cache-mode") + 1] == "align" and "--mamba-cache-mode" not in cmds[1]
    assert [a for a in cmds[0] if a not in ("--mamba-cache-mode", "align")] == cmds[1]


def test_a_run_whose_conversations_outgrow_the_model_is_an_error_in_the_result() -> None:
    lines: list[str] = []
    gemma = MODELS["gemma3"]
    # The full workload on the tiny Gemma3 (2,048 positions): nothing starts (no model folder is read).
    res = serving._one_run("hkvd", Path("/nonexistent"), gemma, 2048, serving.FULL, 390, "off", None, lines.append)
    assert res["error"].startswith("conversations reach 2612 tokens, over the max model len 2048 (gemma3 has "
                                   "2048 positions): use --quick's workload")
    assert res["run"] == "hkvd" and "turns" not in res and lines == [f"    hkvd not run: {res['error']}"]
    notes = serving.summary({"runs": serving.merge_rounds([[res]], serving.FULL.turns)})
    assert notes == [f"hkvd (vLLM + hkvd, small KV memory) did not run: {res['error']}"]
    # A KV memory sized without the sliding-window groups (7 blocks a conversation, 18 small): refused too.
    small = serving._one_run("limit", Path("/nonexistent"), gemma, 1024, serving.QUICK, 18, "off", None,
                             lines.append)
    assert small["error"] == ("18 KV blocks hold less than one conversation: gemma3 needs 28 (blocks of 128 tokens "
                              "in 4 groups): size the memory with MODELS['gemma3'].kv_blocks(workload)")


def _fake_server(workload: Workload, delay_s: float = 0.0):  # type: ignore[no-untyped-def]
    calls: list[tuple[int, int, list[int]]] = []
    live = {"now": 0, "peak": 0}
    lock = threading.Lock()

    def send(conv: int, turn: int, prompt: list[int]) -> Reply:
        with lock:
            calls.append((conv, turn, list(prompt)))
            live["now"] += 1
            live["peak"] = max(live["peak"], live["now"])
        time.sleep(delay_s)
        with lock:
            live["now"] -= 1
        return Reply(conv, turn, len(prompt), 0, workload.answer_tokens, 0.0, 0.01, 0.02,
                     _answer(prompt, workload.answer_tokens))

    return send, calls, live


def test_converse_builds_each_prompt_from_the_last() -> None:
    send, calls, live = _fake_server(W, delay_s=0.05)
    seen: list[Reply] = []
    replies = converse(W, send, seen.append)
    assert len(replies) == len(calls) == 15 and seen == replies
    assert live["peak"] == 2  # the concurrency, never more
    prompts = {(c, t): p for c, t, p in calls}
    for c in range(5):
        assert prompts[(c, 1)] == W.message(c, 1)
        for t in (2, 3):
            prev = prompts[(c, t - 1)]
            assert prompts[(c, t)] == prev + list(_answer(prev, 4)) + W.message(c, t)


def test_converse_sends_the_conversation_that_waited_longest() -> None:
    # One at a time the order is exact: every conversation's turn t, then every one's turn t + 1.
    w = Workload(conversations=3, concurrency=1, turns=3, first_tokens=8, user_tokens=2, answer_tokens=2)
    send, calls, live = _fake_server(w)
    converse(w, send)
    assert [(c, t) for c, t, _ in calls] == [(c, t) for t in (1, 2, 3) for c in range(3)]
    assert live["peak"] == 1


def test_converse_raises_a_failed_turn_and_a_short_answer() -> None:
    def failing(conv: int, turn: int, prompt: list[int]) -> Reply:
        if turn == 2:
            raise TimeoutError("no reply within 1 s")
        return Reply(conv, turn, len(prompt), 0, 4, 0.0, 0.01, 0.02, _answer(prompt, 4))

    with pytest.raises(TimeoutError, match="no reply"):
        converse(W, failing)

    def short(conv: int, turn: int, prompt: list[int]) -> Reply:
        return Reply(conv, turn, len(prompt), 0, 3, 0.0, 0.01, 0.02, _answer(prompt, 3))

    with pytest.raises(RuntimeError, match="3 answer tokens, asked for 4"):
        converse(W, short)


def test_usage_and_metrics_parsing() -> None:
    assert cached_tokens({"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 8}}) == 8
    with pytest.raises(RuntimeError, match="--enable-prompt-tokens-details"):
        cached_tokens({"prompt_tokens": 10})
    text = "\n".join([
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.",
        'vllm:prefix_cache_hits_total{engine="0",model_name="bench"} 512.0',
        'vllm:prefix_cache_hits_total{engine="1",model_name="bench"} 128.0',
        'vllm:external_prefix_cache_hits_total{engine="0",model_name="bench"} 1024.0',
        'vllm:prompt_tokens_total{engine="0",model_name="bench"} 4096.0',
        'vllm:prompt_tokens_created{engine="0",model_name="bench"} 1.7e9',
    ])
    m = parse_metrics(text)
    assert m["local_hits"] == 640 and m["external_hits"] == 1024 and m["prompt_tokens"] == 4096
    assert m["preemptions"] == 0


def test_first_error_names_the_root_cause() -> None:
    log = "\n".join([
        "(APIServer pid=1) WARNING 11-25 [system_utils.py:255] can cause `OSError: [Errno 24] Too many open files`",
        "(Worker pid=2) ERROR 11-25 [multiproc_executor.py:1063]   File \"x.py\", line 805, in register",
        "(Worker pid=2) ERROR 11-25 [multiproc_executor.py:1063] ValueError: engine-driven transfer does not "
        "support multiple KV transfer groups now",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ])
    assert first_error(log) == ("ValueError: engine-driven transfer does not support multiple KV transfer "
                                "groups now")
    assert first_error("plain last line") == "plain last line"


def _replies(ttft_later_s: float, hit_later: int, answer: tuple[int, ...] = (7, 8)) -> list[Reply]:
    out = []
    for c in range(4):
        out.append(Reply(c, 1, 1000, 0, 2, 0.0, 1.0 + c / 10, 1.5 + c / 10, answer))
        out.append(Reply(c, 2, 1200, hit_later, 2, 1.0, ttft_later_s + c / 100, ttft_later_s + 0.5, answer))
    return out


def _run(name: str, ttft_later_s: float, hit_later: int) -> dict:
    rs = _replies(ttft_later_s, hit_later)
    return {"run": name, "label": serving.RUNS[name], "turns": serving.turn_stats(rs, 2), "output_tok_s": 3.0,
            "replies": [r.as_json() for r in rs]}


def test_turn_stats_per_turn_and_later() -> None:
    stats = serving.turn_stats(_replies(0.2, 1024), 2)
    assert [s["turn"] for s in stats] == [1, 2, "later"]
    t1, t2, later = stats
    assert t1["requests"] == 4 and t1["hit_share"] == 0 and t1["prompt_tokens"] == 4000
    assert t2["hit_share"] == pytest.approx(1024 / 1200) and later["hit_share"] == t2["hit_share"]
    assert t1["ttft_ms_p50"] == pytest.approx(1150) and t1["ttft_ms_p99"] == pytest.approx(1300)
    # One token after the first in 0.5 s - 0.01 s x conversation: the median of the four streams.
    assert t2["stream_tok_s_p50"] == pytest.approx((1 / 0.49 + 1 / 0.48) / 2)


def test_ratios_and_targets() -> None:
    runs = [_run("limit", 0.10, 1024), _run("recompute", 1.00, 0), _run("hkvd", 0.105, 1024),
            {"run": "lmcache", "label": serving.RUNS["lmcache"], "error": "ValueError: no multiple groups"}]
    r = serving.ratios(runs)
    assert r["ttft_p50_vs_limit"]["hkvd"] == pytest.approx(0.120 / 0.115)  # medians of 4 later turns
    assert r["ttft_p50_vs_recompute"]["hkvd"] == pytest.approx(0.120 / 1.015)
    assert "lmcache" not in r["hit_share"]
    t = r["targets"]
    assert t["hkvd_vs_limit_ttft"]["met"] and t["hkvd_vs_recompute_ttft"]["met"] and t["hkvd_hit_share"]["met"]
    worse = serving.ratios([_run("limit", 0.10, 1024), _run("recompute", 0.3, 0), _run("hkvd", 0.2, 896)])["targets"]
    assert not worse["hkvd_vs_limit_ttft"]["met"] and not worse["hkvd_vs_recompute_ttft"]["met"]
    assert not worse["hkvd_hit_share"]["met"] and worse["hkvd_hit_share"]["at_least"] == pytest.approx(1024 / 1200)
    alone = serving.ratios([_run("hkvd", 0.2, 896)])["targets"]
    assert alone["hkvd_vs_limit_ttft"] is None and "hkvd_hit_share" not in alone


def test_rounds_pool_replies_and_sum_counters() -> None:
    def played(name: str, ttft: float, loads: float) -> dict:
        return {**_run(name, ttft, 1024), "wall_s": 10.0, "counters": {"hkvd_loads": loads}, "errors_logged": []}

    failed = {"run": "lmcache", "label": serving.RUNS["lmcache"], "error": "ValueError: no multiple groups"}
    rounds = [[played("limit", 0.10, 0), played("hkvd", 0.11, 4), failed],
              [played("limit", 0.20, 0), played("hkvd", 0.21, 5)]]
    limit, hkvd, lm = serving.merge_rounds(rounds, 2)
    assert hkvd["counters"] == {"hkvd_loads": 9} and hkvd["wall_s"] == 20.0 and len(hkvd["rounds"]) == 2
    assert len(hkvd["replies"]) == 16 and "replies" not in hkvd["rounds"][0]
    later = next(t for t in hkvd["turns"] if t["turn"] == "later")
    # The 8 later turns of both rounds: 110, 120, 130, 140 and 210 ... 240 ms; their median.
    assert later["requests"] == 8 and later["ttft_ms_p50"] == pytest.approx((140 + 210) / 2)
    assert hkvd["output_tok_s"] == pytest.approx(16 * 2 / 20.0) and lm == failed
    per_round = [serving.ratios(serving.merge_rounds([r], 2))["ttft_p50_vs_limit"]["hkvd"] for r in rounds]
    bare = [{k: v for k, v in r.items() if k != "counters"} for r in (limit, hkvd, lm)]
    result = {"runs": bare, "ratios": serving.ratios(bare),
              "round_ratios": [{"hkvd": v} for v in per_round]}
    assert per_round == pytest.approx([0.125 / 0.115, 0.225 / 0.215])
    assert "hkvd's later-turn TTFT p50 against the limit's, round by round: 1.09x, 1.05x" in serving.summary(result)


def test_play_rounds_plays_in_order_sizes_the_limit_and_drops_a_failed_run() -> None:
    calls: list[tuple[str, int]] = []
    lines: list[str] = []

    def one_run(name: str, size: int) -> dict:
        calls.append((name, size))
        return {"run": name, "error": "boom"} if name == "lmcache" else {"run": name}

    runs = {"limit": "vLLM alone, ample", "hkvd": "vLLM + hkvd", "lmcache": "vLLM + LMCache"}
    played = serving.play_rounds(runs, 2, {"small": 10, "ample": 40}, lines.append, one_run)
    assert calls == [("limit", 40), ("hkvd", 10), ("lmcache", 10), ("limit", 40), ("hkvd", 10)]
    assert [[r["run"] for r in rnd] for rnd in played] == [["limit", "hkvd", "lmcache"], ["limit", "hkvd"]]
    assert lines[0] == "  round 1/2, run 1/3 limit: vLLM alone, ample (40 blocks)"
    assert lines[-1] == "  round 2/2, run 2/3 hkvd: vLLM + hkvd (10 blocks)"


def _result() -> dict:
    runs = [_run("limit", 0.10, 1024), _run("recompute", 1.00, 0), _run("hkvd", 0.105, 1024),
            {"run": "lmcache", "label": serving.RUNS["lmcache"], "kv_blocks": 440,
             "error": "ValueError: engine-driven transfer does not support multiple KV transfer groups now"}]
    config = {"model": "qwen3_next", "block": 128,
              "kv_blocks": {"per_conversation": 13, "all_conversations": 52, "small": 33, "ample": 104}}
    return {"config": config, "runs": runs, "ratios": serving.ratios(runs)}


def test_table_notes_and_report_section() -> None:
    result = _result()
    text = md_table(*serving.table(result))
    assert "| hkvd | 2+ | 4 (all turns: 3.0 output tok/s) | 85.3% | 120 | 135 |" in text
    assert "| limit | 1 | 4 x 1000 | 0.0% | 1,150 | 1,300 |" in text
    assert "| lmcache | - | error: ValueError: engine-driven transfer does not support multiple KV transfer groups " \
        "now | - | - | - | - |" in text
    notes = serving.notes(result)
    assert notes.startswith("- qwen3_next, KV memory in blocks of 128 tokens: small 33, ample 104; one "
                            "conversation needs 13, all of them 52\n")
    assert "- target hkvd_vs_limit_ttft: 1.04 (at most 1.05): met" in notes
    assert "- target hkvd_hit_share: 85.3% (at least the limit's 85.3%): met" in notes
    assert "- lmcache (vLLM + LMCache MP, small KV memory) did not run: ValueError: engine-driven" in notes
    payload = {"name": "serving", "quick": True, "date": "2026-11-25T00:00:00+00:00", "machine": {"cpus": 2},
               **result}
    section = report.section(payload)
    assert section.startswith("### serving\n\n2026-11-25, quick run, 2 CPUs")
    assert section.endswith(notes)
    skipped = md_table(*serving.table({"skipped": "vllm not installed (make vllm)", "runs": []}))
    assert "vllm not installed" in skipped


def test_plot_is_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib (pip install -e '.[bench]')")
    from bench.common import try_pyplot

    (path,) = serving.plot(try_pyplot(), _result(), tmp_path)
    assert Path(path).name == "serving.png" and Path(path).stat().st_size > 1000


def test_a_target_met_pooled_but_missed_in_a_round_is_missed() -> None:
    """A target clears the spread: met only where the pooled value and every round's value meet it."""
    good = [_run("limit", 0.10, 1024), _run("recompute", 1.00, 0), _run("hkvd", 0.1, 1024)]
    slow = [_run("limit", 0.10, 1024), _run("recompute", 1.00, 0), _run("hkvd", 0.13, 1024)]
    t = serving.ratios(good, [good, good])["targets"]["hkvd_vs_limit_ttft"]
    assert t["met"] and len(t["rounds"]) == 2
    t = serving.ratios(good, [good, slow])["targets"]["hkvd_vs_limit_ttft"]
    assert not t["met"] and t["rounds"][1] > serving.TARGETS["hkvd_vs_limit_ttft"]


def test_pick_runs_keeps_the_bench_order_and_names_the_choices() -> None:
    assert list(serving.pick_runs(serving.RUNS, ["hkvd", "limit"])) == ["limit", "hkvd"]
    assert serving.pick_runs(serving.RUNS, None) == dict(serving.RUNS)
    with pytest.raises(ValueError, match="choose among limit, recompute, hkvd"):
        serving.pick_runs(serving.RUNS, ["hkvdd"])
    with pytest.raises(ValueError, match="not runs of this bench"):
        serving.pick_runs(serving.RUNS, [])
