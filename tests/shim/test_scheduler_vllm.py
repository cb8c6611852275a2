# SPDX-License-Identifier: Apache-2.0
"""The shim against vLLM's real ``Scheduler`` (CPU) and a real ``hkvd serve``; no model runs.

The hand-built hybrid ``KVCacheConfig`` (one full-attention group, one Mamba group, block 16,
align mode, dense retention) reproduces trace A of shared/reference/vllm-connector.md. The
worker half runs in this process against a host buffer laid out like vLLM's (one int8 buffer,
both groups aliased in it), and stands in for the model: after each step it writes a pattern
derived from the prefix into every block the step computed. A later request with the same
prefix, after ``reset_prefix_cache()``, must then load exactly those bytes into its own blocks.
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(180)]

BLOCK = 16
NUM_BLOCKS = 64
PAGE = 2048  # attention page: 1 KV head x 16 tokens x (32 + 32) x bf16; Mamba padded to it
MAMBA_BYTES = 512  # (4, 64) bf16


def _make(model_dir: Any, socket: str, *, batched: int = 32, mamba_mode: str = "align",
          extra: dict | None = None, scheduler_cls: Any = None) -> tuple[Any, Any, Any]:
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MambaSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    vcfg = VllmConfig(
        model_config=ModelConfig(model=str(model_dir), max_model_len=1024, dtype="bfloat16"),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=batched, max_model_len=1024,
                                         enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True, mamba_cache_mode=mamba_mode),
        kv_transfer_config=KVTransferConfig(
            kv_connector="HkvdConnector", kv_connector_module_path="hkvd.shim.connector", kv_role="kv_both",
            # The traces pin which step schedules what: wait for each lookup's answer (poll returns
            # when it arrives) rather than 2 ms, after which vLLM defers the request a step (CI saw it).
            # Sampled verification only where a test asks for it (the traces pin which request loads).
            kv_connector_extra_config={"socket_path": socket, "reconnect_interval_s": 0.2, "lookup_wait_s": 1.0,
                                       "verify_fraction": 0.0, **(extra or {})}),
        device_config=DeviceConfig("cpu"),
    )
    vcfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    attn = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.bfloat16)
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 64),), dtypes=(torch.bfloat16,), page_size_padded=PAGE,
                      mamba_cache_mode=mamba_mode)
    size = PAGE * NUM_BLOCKS
    kvc = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[KVCacheTensor(size=size, layers=["attn0"], layer_stride=size, block_stride=PAGE),
                          KVCacheTensor(size=size, layers=["mamba0"], layer_stride=size, block_stride=PAGE)],
        kv_cache_groups=[KVCacheGroupSpec(["attn0"], attn), KVCacheGroupSpec(["mamba0"], mamba)],
        kv_cache_layout="LBHNC",
    )
    sched = (scheduler_cls or Scheduler)(vcfg, kvc, StructuredOutputManager(vcfg), block_size=BLOCK)
    return vcfg, kvc, sched


class Runner:
    """Steps the real Scheduler and plays the model runner for the worker half."""

    def __init__(self, vcfg: Any, kvc: Any, sched: Any, with_worker: bool = True) -> None:
        import torch
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

        from hkvd.shim.connector import HkvdConnector

        self.sched = sched
        self.kvc = kvc
        self.metas: list[Any] = []
        self.buf = torch.zeros(PAGE * NUM_BLOCKS, dtype=torch.int8)  # both groups alias it, as in vLLM
        self.worker = None
        if with_worker:
            self.worker = HkvdConnector(vcfg, KVConnectorRole.WORKER, kvc)
            self.worker.register_kv_caches({
                "attn0": self.buf.view(NUM_BLOCKS, PAGE),
                "mamba0": self.buf.view(NUM_BLOCKS, PAGE)[:, :MAMBA_BYTES],
            })
        self.tokens: dict[str, list[int]] = {}  # each request's tokens: its prompt, then what sample() gave

    def sample(self, req_id: str) -> int:
        """The token the fake model samples for ``req_id`` (appended to its tokens)."""
        self.tokens[req_id].append(7)
        return 7

    def add(self, req_id: str, tokens: list[int], max_tokens: int = 1) -> Any:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        req = Request(req_id, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0), None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
        self.tokens[req_id] = list(tokens)
        self.sched.add_request(req)
        return req

    @staticmethod
    def pattern(tokens: list[int], upto: int, page: int) -> bytes:
        return (hashlib.blake2b(str(tokens[:upto]).encode(), digest_size=16).digest() * (page // 16))[:page]

    def _write(self, block: int, data: bytes) -> None:
        import torch

        self.buf[block * PAGE: block * PAGE + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.int8)

    def read(self, block: int, n: int) -> bytes:
        return self.buf[block * PAGE: block * PAGE + n].numpy().tobytes()

    def step(self) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.sched.schedule()
        self.last_so = so
        meta = so.kv_connector_metadata
        self.metas.append(meta)
        out_conn = KVConnectorOutput()
        if self.worker is not None:
            w = self.worker
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            self._forward(so)
            w.wait_for_save()
            res = w.get_transfer_results(so.finished_req_ids)  # as vLLM's model runner asks
            out_conn = KVConnectorOutput(finished_sending=res.finished_sending, finished_recving=res.finished_recving,
                                         failed_recving=res.failed_recving,
                                         invalid_block_ids=w.get_block_ids_with_load_errors())
            w.clear_connector_metadata()
            self._drain()
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            req = self.sched.requests[rid]
            done = req.num_computed_tokens >= req.num_tokens  # schedule() already advanced it
            sampled.append([self.sample(rid)] if done else [])
        mro = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
                                pooler_output=[], kv_connector_output=out_conn)
        self.sched.update_from_output(so, mro)
        return meta

    def _forward(self, so: Any) -> None:
        """Write the prefix pattern into every block this step computes (attention and Mamba)."""
        for rid, n in so.num_scheduled_tokens.items():
            req = self.sched.requests[rid]
            toks = self.tokens[rid]
            start, end = req.num_computed_tokens - n, req.num_computed_tokens  # advanced by schedule()
            table = self.sched.kv_cache_manager.get_block_ids(rid)
            for b in range(start // BLOCK, -(-end // BLOCK)):
                if b < len(table[0]) and table[0][b]:
                    self._write(table[0][b], self.pattern(toks, min((b + 1) * BLOCK, end), PAGE))
            if end % BLOCK == 0 and end // BLOCK - 1 < len(table[1]) and table[1][end // BLOCK - 1]:
                self._write(table[1][end // BLOCK - 1], self.pattern(toks, end, MAMBA_BYTES))

    def _drain(self, timeout_s: float = 5.0) -> None:
        """Let this step's copies finish before the next step (deterministic confirms)."""
        side = self.worker._worker  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout_s
        while side._jobs and time.monotonic() < deadline:
            side._pump(0.01)

    def wait_loads(self, timeout_s: float = 5.0) -> None:
        """Read replies until no load is in flight (the daemon has written every loaded byte)."""
        side = self.worker._worker  # type: ignore[union-attr]
        deadline = time.monotonic() + timeout_s
        while side.loads.in_flight and time.monotonic() < deadline:
            side._pump(0.01)
        assert not side.loads.in_flight, "a load got no reply"

    def run(self, max_steps: int = 30) -> None:
        for _ in range(max_steps):
            if not self.sched.has_unfinished_requests():
                break
            self.step()
        for _ in range(3):  # empty steps carry the last confirms
            self.step()


@pytest.fixture
def qwen_dir(tiny_models: dict) -> Any:
    return tiny_models["gemma3"]  # any local model dir: the KVCacheConfig is built by hand


def _items(meta: Any) -> tuple[list, list]:
    stores = [(it[0], it[1], it[3]) for sj in meta.stores for it in sj.items]
    offers = [(r, it[0], it[1], it[3]) for r, it in meta.offers]
    return stores, offers


def test_trace_a_descriptors_and_external_load(qwen_dir, daemon_factory) -> None:
    d = daemon_factory(chunk_size=BLOCK)
    vcfg, kvc, sched = _make(qwen_dir, d.socket)
    run = Runner(vcfg, kvc, sched)
    prompt = list(range(10, 80))  # 70 tokens
    run.add("r1", prompt)
    m0 = run.step()
    m1 = run.step()
    m2 = run.step()
    # Trace A: s0 tables ([1,2],[0,3]) offers (g1, blk 3, 32); s1 ([1,2,4,5],[0,3,0,6]) offers blk 6 at 64.
    assert _items(m0) == ([(0, 0, [1]), (0, 1, [2])], [("r1", 1, 1, [3])])
    assert _items(m1) == ([(0, 2, [4]), (0, 3, [5])], [("r1", 1, 3, [6])])
    assert _items(m2) == ([], [])  # 70 tokens: chunk 4 is not full
    assert m0.fence_blocks == {1, 2, 3} and {4, 5, 6} <= m1.fence_blocks
    run.run()
    assert "r1" not in sched.requests  # freed after the worker reported its copies done

    sched.reset_prefix_cache()  # vLLM's local cache is gone; hkvd still has the prefix
    run.add("r3", prompt)
    m = run.step()
    (load,) = m.loads
    attn = [it for it in load.items if it[0] == 0]
    (mamba,) = [it for it in load.items if it[0] == 1]
    # The load is asynchronous for vLLM: r3 waits (WAITING_FOR_REMOTE_KVS) while it is loaded.
    assert not run.last_so.scheduled_new_reqs
    table = sched.kv_cache_manager.get_block_ids("r3")  # as allocated (the Mamba entry retires later)
    assert [it[1] for it in attn] == [0, 1, 2, 3] and [it[3][0] for it in attn] == table[0][:4]
    assert mamba[1] == 3 and mamba[3] == [table[1][3]]  # state(64) into index 64/16 - 1
    assert sched.requests["r3"].num_computed_tokens >= 64
    run.wait_loads()
    assert run.worker._worker.loads.stats["loads_ok"] == 1  # type: ignore[union-attr]
    for i in range(4):  # the bytes r1 computed, now in r3's blocks
        assert run.read(table[0][i], PAGE) == Runner.pattern(prompt, (i + 1) * BLOCK, PAGE)
    assert run.read(table[1][3], MAMBA_BYTES) == Runner.pattern(prompt, 64, MAMBA_BYTES)
    run.run()


def test_daemon_down_recomputes_with_one_warning(qwen_dir, daemon_factory, caplog) -> None:
    d = daemon_factory(chunk_size=BLOCK)
    vcfg, kvc, sched = _make(qwen_dir, d.socket)
    run = Runner(vcfg, kvc, sched)
    d.stop()
    caplog.set_level(logging.WARNING, logger="hkvd.shim")
    for i in range(3):
        run.add(f"q{i}", list(range(10 + i, 80 + i)))
        run.run()
        assert f"q{i}" not in sched.requests
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]  # one per side, not one per call
    d.start()
    time.sleep(0.3)  # past reconnect_interval_s
    run.add("back", list(range(10, 80)))
    run.run()
    assert run.worker._worker.link.up and sched.connector._sched.link.up  # type: ignore[union-attr]


def test_startup_validation_names_the_fix(qwen_dir, daemon_factory) -> None:
    d = daemon_factory(chunk_size=BLOCK)
    with pytest.raises(ValueError, match="multiple of vLLM's block size"):
        _make(qwen_dir, d.socket, extra={"chunk_size": 24})
    # The daemon's own validation travels back through registration, fix included.
    with pytest.raises(Exception, match="--max-num-batched-tokens 16"):
        _make(qwen_dir, d.socket, batched=8)
    with pytest.raises(ValueError, match="--mamba-cache-mode align"):
        _make(qwen_dir, d.socket, mamba_mode="none")


def test_failed_load_fails_the_request_and_recomputes_it(qwen_dir, daemon_factory) -> None:
    # vLLM 0.32 stops an engine whose connector reports block-level load errors for a model with
    # several KV-cache groups (every hybrid): a failed load must come back as a failed request.
    d = daemon_factory(chunk_size=BLOCK)
    vcfg, kvc, sched = _make(qwen_dir, d.socket)
    run = Runner(vcfg, kvc, sched)
    prompt = list(range(10, 80))
    run.add("r1", prompt)
    run.run()
    sched.reset_prefix_cache()
    run.add("r3", prompt)
    side = run.worker._worker  # type: ignore[union-attr]
    load = side.start_load_kv

    def daemon_dies_first() -> None:
        d.proc.kill()  # kill -9 between the lookup's hit and the load
        d.proc.wait()
        load()

    side.start_load_kv = daemon_dies_first
    m = run.step()  # update_from_output raised here when the failure went out as block ids
    side.start_load_kv = load
    assert len(m.loads) == 1 and side.loads.stats["loads_failed"] == 1 and side.loads.stats["loads_ok"] == 0
    computed = 0
    while "r3" in sched.requests:
        run.step()
        computed += run.last_so.num_scheduled_tokens.get("r3", 0)
    assert computed == len(prompt)  # recomputed from the first token, and not loaded again


class HeldReplies:
    """The worker's daemon client, whose Retrieve replies the test hands over when it says so.

    Everything goes to the real client and the real daemon copies at once; only the worker's view
    of a load's end is held back. That is the order a slow copy (thousands of tokens) gives.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self.held: dict[int, Any] = {}
        self.retrieves: list[int] = []
        self.hold = True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def submit_retrieve(self, items: Any, lease_id: int) -> int:
        rid = self._client.submit_retrieve(items, lease_id)
        self.retrieves.append(rid)
        return int(rid)

    def _keep(self, done: list[Any]) -> list[Any]:
        out = []
        for c in done:
            if self.hold and c.req_id in self.retrieves:
                self.held[c.req_id] = c
            else:
                out.append(c)
        return out

    def poll(self, timeout_s: float = 0.0) -> list[Any]:
        out = self._keep(self._client.poll(timeout_s))
        if not self.hold:
            out += list(self.held.values())
            self.held.clear()
        return out

    def wait(self, req_ids: Any, timeout_s: float) -> dict[int, Any]:
        assert not set(req_ids) & set(self.retrieves), "a step waited for a load"
        return dict(self._client.wait(req_ids, timeout_s))


def _loaded_prefix_setup(qwen_dir: Any, daemon_factory: Any, early_load_reports: bool = False
                         ) -> tuple[Any, Runner, HeldReplies, list[int]]:
    """r3's load is in flight for its worker, whose replies are held. Only the workers report loads
    unless ``early_load_reports``."""
    d = daemon_factory(chunk_size=BLOCK)
    vcfg, kvc, sched = _make(qwen_dir, d.socket, extra={"early_load_reports": early_load_reports})
    run = Runner(vcfg, kvc, sched)
    prompt = list(range(10, 80))  # 70 tokens: 4 chunks of 16 cached
    run.add("r1", prompt)
    run.run()
    sched.reset_prefix_cache()
    side = run.worker._worker  # type: ignore[union-attr]
    held = side.link.client = HeldReplies(side.link.client)
    run.add("dec", list(range(300, 320)), max_tokens=25)  # decodes one token per step
    run.step()
    run.add("r3", prompt)
    m = run.step()
    assert [j.req_id for j in m.loads] == ["r3"] and len(held.retrieves) == 1
    return sched, run, held, prompt


def test_a_loading_request_waits_while_the_others_step(qwen_dir, daemon_factory) -> None:
    from vllm.v1.request import RequestStatus

    sched, run, held, prompt = _loaded_prefix_setup(qwen_dir, daemon_factory)
    side = run.worker._worker  # type: ignore[union-attr]
    deadline = time.monotonic() + 5.0
    while not held.held and time.monotonic() < deadline:  # the daemon's copy is over, its reply held
        side._pump(0.01)
    assert held.held
    for _ in range(4):  # the load is in flight for the worker: the decoding request keeps stepping
        run.step()
        assert run.last_so.num_scheduled_tokens == {"dec": 1}
        assert sched.requests["r3"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert side.loads.requests() == {"r3"}
    held.hold = False
    run.step()  # reports r3 finished receiving
    run.step()
    assert run.last_so.num_scheduled_tokens == {"dec": 1, "r3": len(prompt) - 64}
    table = sched.kv_cache_manager.get_block_ids("r3")
    for i in range(4):  # the bytes r1 computed, in r3's blocks
        assert run.read(table[0][i], PAGE) == Runner.pattern(prompt, (i + 1) * BLOCK, PAGE)
    assert side.loads.stats["loads_ok"] == 1
    run.run()


def test_the_scheduler_reports_a_load_the_daemon_wrote_before_its_worker_reads_the_reply(
        qwen_dir, daemon_factory) -> None:
    # Under vLLM's async scheduling the worker's report reaches the scheduler a step late; a held
    # reply plays that delay here. The scheduler side's lease watch does not wait for it.
    sched, run, held, prompt = _loaded_prefix_setup(qwen_dir, daemon_factory, early_load_reports=True)
    side = run.worker._worker  # type: ignore[union-attr]
    scheduler_side = sched.connector._sched
    deadline = time.monotonic() + 5.0
    while not held.held and time.monotonic() < deadline:  # the daemon's copy is over, its reply held
        side._pump(0.01)
    assert held.held and side.loads.requests() == {"r3"}
    if scheduler_side.stats["loads_reported_early"] == 0:  # the watch's Done came after that step's output
        run.step()
        assert run.last_so.num_scheduled_tokens == {"dec": 1}
    assert scheduler_side.stats["loads_reported_early"] == 1
    run.step()  # the worker has not read its reply, yet r3 runs
    assert run.last_so.num_scheduled_tokens == {"dec": 1, "r3": len(prompt) - 64}
    table = sched.kv_cache_manager.get_block_ids("r3")
    for i in range(4):  # the bytes r1 computed, in r3's blocks
        assert run.read(table[0][i], PAGE) == Runner.pattern(prompt, (i + 1) * BLOCK, PAGE)
    held.hold = False
    run.step()  # the worker's own report of r3 now comes, and is taken out: vLLM asserts it never sees it twice
    assert side.loads.stats["loads_ok"] == 1 and not scheduler_side.loads.reported_early
    run.run()
    assert not sched.has_unfinished_requests()


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_load_ends(qwen_dir, daemon_factory) -> None:
    from vllm.v1.request import RequestStatus

    sched, run, held, _prompt = _loaded_prefix_setup(qwen_dir, daemon_factory)
    pool = sched.kv_cache_manager.block_pool
    blocks = [b for ids in sched.kv_cache_manager.get_block_ids("r3") for b in ids if b]
    # As for a request that stored chunks before it was preempted and is now loaded back: its free
    # would be delayed for its copies, and a report in finished_sending would free the blocks while
    # the daemon writes into them (and vLLM's later finished_recving would find no request).
    sched.connector._sched.ctx.reqs["r3"].had_copies = True
    sched.finish_requests("r3", RequestStatus.FINISHED_ABORTED)
    for _ in range(3):  # the daemon may still be writing into them: vLLM must not reuse them
        run.step()
        assert "r3" in sched.requests and all(pool.blocks[b].ref_cnt > 0 for b in blocks)
    assert sched.connector._sched.stores.delayed == []  # no second free through finished_sending
    held.hold = False
    run.step()  # the reply: the load is reported and vLLM frees the blocks, once
    assert "r3" not in sched.requests
    assert all(pool.blocks[b].ref_cnt == 0 for b in blocks if b not in
               {x for ids in sched.kv_cache_manager.get_block_ids("dec") for x in ids})
    run.run()
    assert not sched.has_unfinished_requests()


def test_a_lookup_waits_on_past_other_replies_that_come_first(qwen_dir, daemon_factory) -> None:
    # The scheduler's connection also carries lease watches: a watch's reply read first must not make
    # the scheduler pass the request over for a step (lookups_deferred) while its lookup's reply is due.
    from hkvd.shim.results import Completion
    from hkvd.transport.wire.kv import LeaseWritten

    d = daemon_factory(chunk_size=BLOCK)
    vcfg, kvc, sched = _make(qwen_dir, d.socket)
    run = Runner(vcfg, kvc, sched)
    side = sched.connector._sched
    real = side.link.client

    class WatchReplyFirst:
        def __init__(self) -> None:
            self.first = True

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def poll(self, timeout_s: float = 0.0) -> list[Any]:
            if self.first and side.lookups.by_lookup:
                self.first = False
                side.loads.watches[999_999] = ("gone", 1)  # a watch whose request finished meanwhile
                return [Completion(999_999, True, LeaseWritten(999_999), None)]
            return list(real.poll(timeout_s))

    side.link.client = WatchReplyFirst()
    run.add("r1", list(range(10, 80)))
    run.step()
    assert side.stats["lookups"] == 1 and side.stats["lookups_deferred"] == 0
    assert run.last_so.num_scheduled_tokens == {"r1": 32}
    run.run()
