# SPDX-License-Identifier: Apache-2.0
"""Chunks that fill while vLLM generates (``store_decode``), against vLLM's real ``Scheduler`` and
``AsyncScheduler`` and a real ``hkvd serve``; no model runs.

The harness is test_scheduler_vllm's (one full-attention group + one Mamba group, block = chunk = 16,
align mode, dense retention): after each step the fake model writes a pattern derived from the exact
prefix into every block the step computed, attention and Mamba. Here it also samples a token per
position, so the answer's chunks have keys of their own. A later request whose prompt repeats the
answer (a chat's next turn) must load exactly the bytes the answer's decode steps wrote.

Under ``AsyncScheduler`` the step after a sample is scheduled before that sample's output is
processed (vLLM's async engine loop): the token a step feeds is a placeholder for the scheduler, so
a chunk's last token is known only one step after the step that computed its KV.
"""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

MODES = ("sync", "async")


@pytest.fixture(scope="module")
def h():  # type: ignore[no-untyped-def]
    """test_scheduler_vllm's harness (``_make``, ``Runner``, ``BLOCK``, ``PAGE``, ``MAMBA_BYTES``)."""
    import importlib
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    try:
        return importlib.import_module("test_scheduler_vllm")
    finally:
        sys.path.remove(here)


def _runner(h: Any, model_dir: Any, socket: str, mode: str, **extra: Any) -> Any:
    """A Runner whose fake model samples a distinct token per position; async mode defers outputs. Turn-end
    states are off unless asked for: these tests follow whole chunks (a turn end would extend each next
    turn's hit past them, tests/shim/test_prefix_match_unit_vllm.py)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    extra = {"turn_end_states": False, **extra}
    vcfg, kvc, sched = h._make(model_dir, socket, extra=extra,
                               scheduler_cls=AsyncScheduler if mode == "async" else None)

    class DecodeRunner(h.Runner):  # type: ignore[misc, name-defined]
        pending: list[tuple[Any, Any]]
        done_after: list[dict[str, int]]  # per step: tokens each scheduled request has KV for after it

        def sample(self, req_id: str) -> int:
            toks = self.tokens[req_id]
            toks.append((len(toks) * 37 + 11) % 400 + 20)
            return toks[-1]

        def step(self) -> Any:
            meta = super().step() if mode == "sync" else self._async_step()
            so = self.last_so
            before = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
            before.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens,
                              strict=False))
            self.done_after.append({r: before[r] + n for r, n in so.num_scheduled_tokens.items()})
            return meta

        def _async_step(self, process_previous: bool = True) -> Any:
            """Like Runner.step, but this step's output is processed after the next step is scheduled
            (``process_previous=False``: not yet, as when an abort arrives in between)."""
            from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

            so = self.sched.schedule()
            self.last_so = so
            meta = so.kv_connector_metadata
            self.metas.append(meta)
            w = self.worker
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            self._forward(so)
            w.wait_for_save()
            res = w.get_transfer_results(so.finished_req_ids)
            out_conn = KVConnectorOutput(finished_sending=res.finished_sending, finished_recving=res.finished_recving,
                                         failed_recving=res.failed_recving,
                                         invalid_block_ids=w.get_block_ids_with_load_errors())
            w.clear_connector_metadata()
            self._drain()
            req_ids = list(so.num_scheduled_tokens)
            sampled = []
            for rid in req_ids:  # the fake model knows every token it fed, placeholders included
                fed = self.sched.requests[rid].num_computed_tokens if rid in self.sched.requests else 0
                sampled.append([self.sample(rid)] if fed >= len(self.tokens[rid]) else [])
            mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                    sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                    pooler_output=[], kv_connector_output=out_conn)
            self.pending.append((so, mro))
            if process_previous and len(self.pending) > 1:
                self.sched.update_from_output(*self.pending.pop(0))
            return meta

        def flush(self) -> None:
            """Process every output still pending (the async engine draining its queue)."""
            while getattr(self, "pending", None):
                self.sched.update_from_output(*self.pending.pop(0))

        def run(self, max_steps: int = 2000) -> None:
            for _ in range(max_steps):
                if not self.sched.has_unfinished_requests() and not getattr(self, "pending", None):
                    break
                self.step()
                if not self.last_so.num_scheduled_tokens:
                    self.flush()
            self.flush()
            for _ in range(3):  # empty steps carry the last confirms
                self.step()
            self.flush()

    run = DecodeRunner(vcfg, kvc, sched)
    run.pending, run.done_after = [], []
    return run


def _truth(run: Any, req_id: str) -> list[int]:
    return list(run.tokens[req_id])


def _served(h: Any, run: Any, req_id: str, prompt: list[int]) -> tuple[int, list[Any]]:
    """Add ``req_id`` with ``prompt`` after a prefix-cache reset; (hit tokens, its load items)."""
    assert run.sched.reset_prefix_cache()
    run.add(req_id, prompt, max_tokens=1)
    loads = []
    for _ in range(20):
        meta = run.step()
        loads += [job for job in meta.loads if job.req_id == req_id]
        req = run.sched.requests.get(req_id)
        if req is None or req.num_computed_tokens:
            break
    run.flush()
    assert len(loads) <= 1
    hit = max((it[1] + 1 for job in loads for it in job.items), default=0) * h.BLOCK
    return hit, (loads[0].items if loads else [])


def _check_bytes(h: Any, run: Any, items: list[Any], truth: list[int]) -> None:
    """Every loaded block holds what the fake model computed for exactly that prefix of ``truth``."""
    for group_id, chunk, _key, block_ids, *_ in items:
        upto = (chunk + 1) * h.BLOCK
        if group_id == 0:
            assert run.read(block_ids[0], h.PAGE) == h.Runner.pattern(truth, upto, h.PAGE), f"attention chunk {chunk}"
        else:
            assert run.read(block_ids[0], h.MAMBA_BYTES) == h.Runner.pattern(truth, upto, h.MAMBA_BYTES), \
                f"Mamba state at {upto}"


@pytest.mark.parametrize("mode", MODES)
def test_next_turn_hits_the_answer(h, tiny_models, daemon_factory, mode: str) -> None:
    from hkvd.transport.keys import chunk_keys

    d = daemon_factory(chunk_size=16)
    run = _runner(h, tiny_models["gemma3"], d.socket, mode)
    prompt = list(range(10, 50))  # 40 tokens: 2 full chunks; chunk 2 spans prompt and answer
    run.add("turn1", prompt, max_tokens=40)
    run.run()
    answer = _truth(run, "turn1")
    assert len(answer) == 80
    # KV exists for positions < 79 (the last sampled token is never fed): chunks 0..3 are complete.
    stored = sorted({(it[0], it[1]) for m in run.metas for sj in m.stores if sj.req_id == "turn1" for it in sj.items})
    offered = sorted({(it[0], it[1]) for m in run.metas for r, it in m.offers if r == "turn1"})
    assert stored == [(0, 0), (0, 1), (0, 2), (0, 3)]
    # Dense retention: a state at every boundary a step ends on (the first step computes 32 tokens),
    # the answer's too.
    assert offered == [(1, 1), (1, 2), (1, 3)]
    # Stored in the step whose forward completes the chunk; under async scheduling the chunk's last
    # token is still a placeholder then, so one step later.
    stored_at = {it[1]: i for i, m in enumerate(run.metas) for sj in m.stores for it in sj.items}
    for chunk in (2, 3):
        computed_at = next(i for i, done in enumerate(run.done_after) if done.get("turn1", 0) >= (chunk + 1) * 16)
        assert stored_at[chunk] == computed_at + (mode == "async"), (chunk, stored_at, computed_at)

    turn2 = answer + list(range(300, 310))  # the next turn: prompt + answer + a new message
    hit, items = _served(h, run, "turn2", turn2)
    assert hit == 64, items
    assert [it[2] for it in items if it[0] == 0] == chunk_keys(turn2, 16)[:4]  # the next turn's own keys
    _check_bytes(h, run, items, answer)
    run.run()

    # With store_decode off, only the prompt's chunks (and its boundary state at 32) are stored.
    d2 = daemon_factory(chunk_size=16)
    off = _runner(h, tiny_models["gemma3"], d2.socket, mode, store_decode=False)
    off.add("turn1", prompt, max_tokens=40)
    off.run()
    assert _truth(off, "turn1") == answer
    # Counted: chunks 2 and 3 (KV for positions < 79), for the engine's setting (hkvd.shim.decode_stores).
    stats = off.sched.connector._sched.stats
    assert stats["decode_chunks_not_stored_config"] == 2 and stats["decode_bytes_not_stored_config"] > 0, stats
    assert stats["decode_chunks_not_stored_template"] == stats["decode_chunks_not_stored_request"] == 0
    hit, items = _served(h, off, "turn2", turn2)
    assert hit == 32
    _check_bytes(h, off, items, answer)
    off.run()


def test_async_abort_stores_what_was_confirmed(h, tiny_models, daemon_factory) -> None:
    """A request aborted once its outputs are processed but before it is scheduled again: the chunk
    whose last token the scheduler learned last is stored when the request finishes, from the blocks
    it hands back (their free waits for the copy). A chunk whose last token it never learned is not."""
    from vllm.v1.request import RequestStatus

    d = daemon_factory(chunk_size=16)
    run = _runner(h, tiny_models["gemma3"], d.socket, "async")
    prompt = list(range(10, 50))
    run.add("a", prompt, max_tokens=100)
    while run.sched.requests["a"].num_computed_tokens < 64:  # the step that computes KV for position 63
        run.step()
    run.flush()  # its outputs are processed: token 63 is known, nothing is in flight
    req = run.sched.requests["a"]
    assert req.num_tokens == 65 and req.num_computed_tokens == 64
    assert 3 not in {it[1] for m in run.metas for sj in m.stores for it in sj.items}  # not keyed yet
    block = run.sched.kv_cache_manager.get_block_ids("a")[0][3]
    run.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    meta = run.step()
    (job,) = [sj for sj in meta.stores if sj.req_id == "a"]
    assert [(it[1], it[3]) for it in job.items] == [(3, [block])] and "a" in meta.delayed_free
    assert run.read(block, h.PAGE) == h.Runner.pattern(_truth(run, "a"), 64, h.PAGE)
    run.run()
    side = run.worker._worker
    jobs = sum(sj.req_id == "a" for m in run.metas for sj in m.stores)
    assert side.stats["stores_failed"] == 0 and side.stats["stores"] == jobs  # the finish job was copied too
    # vLLM drops the request's Mamba hand-off at 64 with its blocks (it was to be offered at the next
    # schedule), so this hybrid is served up to the state at 48; an attention-only model up to 64.
    hit, items = _served(h, run, "b", _truth(run, "a") + [7] * 20)
    assert hit == 48
    _check_bytes(h, run, items, _truth(run, "a"))
    run.run()

    # Aborted while the step that feeds position 79 is in flight and token 79 unknown: chunk 4 is not stored.
    run.add("c", list(range(100, 140)), max_tokens=100)
    while run.sched.requests["c"].num_computed_tokens < 79:
        run.step()
    run._async_step(process_previous=False)
    assert run.sched.requests["c"].num_tokens == 79 and run.sched.requests["c"].num_computed_tokens == 80
    run.sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    run.run()
    stored_c = {it[1] for m in run.metas for sj in m.stores if sj.req_id == "c" for it in sj.items}
    assert stored_c == {0, 1, 2, 3}


@pytest.mark.parametrize("mode", MODES)
def test_preempted_in_decode_serves_only_what_it_computed(h, tiny_models, daemon_factory, mode: str) -> None:
    """Two requests decode until vLLM's 64 blocks run out and it preempts one mid-decode: the blocks it
    held go to the other at once. Chunks stored before the preemption stay served; every byte served
    for the preempted request's prefix, before and after it resumed, is what it computed there."""
    from hkvd.transport.keys import chunk_keys
    from hkvd.transport.wire.kv import LookupReply

    d = daemon_factory(chunk_size=16)
    run = _runner(h, tiny_models["gemma3"], d.socket, mode)
    run.add("a", list(range(10, 110)), max_tokens=500)
    run.add("b", list(range(200, 300)), max_tokens=500)
    victim = None
    for _ in range(600):
        run.step()
        victim = next(iter(run.last_so.preempted_req_ids or ()), None)
        if victim:
            break
    assert victim, "no preemption: the pool did not run out"
    truth_at_preemption = _truth(run, victim)
    assert 300 < len(truth_at_preemption) < 600  # preempted in the middle of its answer
    # What it stored before the preemption is still served (a lookup over its tokens so far).
    client = run.sched.connector._sched.link.client
    keys = chunk_keys(truth_at_preemption, 16)
    rid = client.submit_lookup(keys, lease=False)
    before = client.wait([rid], 5.0)[rid].get(LookupReply).hit_chunks
    # Every chunk it completed before the preemption (async: but the one whose last token was in flight).
    assert before >= (len(truth_at_preemption) - 2) // 16 - (mode == "async"), (before, len(truth_at_preemption))
    run.run()
    assert run.sched.requests.get(victim) is None
    truth = _truth(run, victim)
    assert truth[:len(truth_at_preemption)] == truth_at_preemption and len(truth) == 600
    hit, items = _served(h, run, "next", truth + [5] * 5)
    assert hit == 592  # KV through position 598: 37 chunks
    _check_bytes(h, run, items, truth)
    run.run()


def test_answer_keys_are_the_next_turns_prompt_keys() -> None:
    """The keys of a request's answer chunks equal those the next turn's prompt (the same tokens, the
    same image, LoRA adapter and cache_salt) computes, and differ under another adapter or salt."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    from hkvd.shim.identity import prompt_tokens
    from hkvd.shim.request_keys import ChunkKeys
    from hkvd.shim.request_state import RequestRecord

    chunk_keys = ChunkKeys(16, store_decode=True)  # the scheduler side's keying: no daemon, no vLLM config

    def request(req_id: str, tokens: list[int], lora: str = "a", salt: str = "t1") -> Request:
        image = MultiModalFeatureSpec(data=None, modality="image", identifier="img-1",
                                      mm_position=PlaceholderRange(offset=20, length=40))
        return Request(req_id, tokens, SamplingParams(max_tokens=60), None, mm_features=[image],
                       lora_request=LoRARequest(lora, 1 if lora == "a" else 2, f"/nonexistent/{lora}"),
                       cache_salt=salt)

    def keys(req: Request, n: int) -> list[bytes]:
        st = RequestRecord(req.request_id, prompt_tokens(req), req.num_prompt_tokens, request=req)
        return chunk_keys.through(st, n)

    first = request("turn1", list(range(10, 110)))  # 100 tokens: 6 full chunks, the image in chunks 1-3
    for t in range(60):
        first.append_output_token_ids(200 + t)
    answer_keys = keys(first, 10)
    assert len(answer_keys) == 10  # 160 tokens known
    nxt = list(first.all_token_ids) + list(range(300, 340))
    assert keys(request("turn2", nxt), 12)[:10] == answer_keys
    for other in (request("lora-b", nxt, lora="b"), request("salt-2", nxt, salt="t2")):
        assert all(a != b for a, b in zip(keys(other, 12), answer_keys, strict=False))
    chunk_keys.store_decode = False
    off = request("off", list(range(10, 110)))
    for t in range(60):
        off.append_output_token_ids(200 + t)
    assert keys(off, 10) == answer_keys[:6]  # prompt chunks only
