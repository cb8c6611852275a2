"""The scheduler's metadata (``hkvd.shim.metadata``): built by ``SchedulerSide`` from vLLM-shaped
inputs, pickled as vLLM ships it to the workers, and consumed by ``WorkerSide``.

No daemon and no model: both halves talk to the shim's one fake daemon (``FakeDaemon``), which answers
lookups and records what the worker submits. vLLM's own objects (``Request``, ``KVCacheConfig``) are real; the scheduler
output and the block tables are the few attributes the shim reads of them.
"""

from __future__ import annotations

import logging
import pickle
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build: make vllm")

import torch
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.request import Request

from hkvd.shim.jobs import LoadJob, PullSpec, StoreJob, item_blocks
from hkvd.shim.metadata import HkvdConnectorMetadata
from hkvd.shim.request_state import InvalidTransition, State
from hkvd.shim.results import Completion
from hkvd.shim.scheduler import SchedulerSide
from hkvd.shim.shim_config import ShimConfig
from hkvd.shim.spec import GroupInfo
from hkvd.shim.testing.fake_daemon import FakeDaemon
from hkvd.shim.worker import WorkerSide
from hkvd.transport.keys import chunk_keys, partial_key
from hkvd.transport.wire.control import RegisterAck
from hkvd.transport.wire.kv import Item

pytestmark = pytest.mark.vllm

BLOCK = 16
CHUNK = 32  # two blocks
BLOCKS = 64
TABLE = list(range(1, 9))  # the request's block ids (vLLM's block 0 is its null block)


def kv_cache_config() -> KVCacheConfig:
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float16)
    page = spec.page_size_bytes
    return KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[KVCacheTensor(page * BLOCKS, ["layer.0"], 0, page)],
                         kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])


def vllm_config() -> Any:
    return SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BLOCK, enable_prefix_caching=True),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, world_size=1),
        kv_transfer_config=SimpleNamespace(kv_role="kv_both"), kv_events_config=None)


@pytest.fixture
def sched() -> SchedulerSide:
    # No daemon at this path: the scheduler starts unconnected; the scripted client stands in for it.
    side = SchedulerSide(vllm_config(), kv_cache_config(),
                         ShimConfig(socket_path="/nonexistent/hkvd.sock", chunk_size=CHUNK))
    return side


def connect(side: SchedulerSide, client: FakeDaemon, *, verify: bool = True, pins: bool = True,
            tails: bool = True, ends: bool = False) -> None:
    side.link.client, side.link.ack = client, RegisterAck(0, 1, b"f" * 16, side.chunk_size, 0, verify=verify,
                                                          pins=pins, lookup_tails=tails, turn_ends=ends)
    side.link.generation += 1


def worker(client: FakeDaemon) -> WorkerSide:
    w = WorkerSide(None, None, ShimConfig(socket_path="/nonexistent/hkvd.sock", chunk_size=CHUNK))
    w.link.client = client
    w._regions = [object()]  # registered (the regions' content is not read here)
    return w


def scheduler_output(req: Request, computed: int, scheduled: int) -> Any:
    """The parts of vLLM's ``SchedulerOutput`` the shim reads: one new request and its block table."""
    tables = {req.request_id: (TABLE,)}
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(TABLE,), num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={req.request_id: scheduled}, total_num_scheduled_tokens=scheduled,
        kv_connector_block_state=SimpleNamespace(get_block_ids=tables.get, boundary_state_offloads=None))


def test_a_hit_becomes_a_load_and_the_rest_of_the_prompt_a_store_the_worker_submits(sched: SchedulerSide) -> None:
    client = FakeDaemon(hit=2, lease_id=77)
    connect(sched, client)
    req = Request("r1", list(range(100)), SamplingParams(max_tokens=4), None)  # 3 full chunks, 4 tokens over

    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)  # async load of chunks 0-1
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (TABLE,)), 2 * CHUNK)
    meta = sched.build_connector_meta(scheduler_output(req, computed=2 * CHUNK, scheduled=100 - 2 * CHUNK))
    keys = client.kinds("lookup")[0][2]

    assert isinstance(meta, KVConnectorMetadata) and meta.step == 1
    [load] = meta.loads
    assert (load.req_id, load.lease_id, load.block_ids, load.pull) == ("r1", 77, [1, 2, 3, 4], None)
    assert load.items == [Item(0, 0, keys[0], [1, 2]), Item(0, 1, keys[1], [3, 4])]
    # Chunk 2 completes in this step's forward: stored after it, never the chunks the load brings.
    [store] = meta.stores
    assert (store.req_id, store.items) == ("r1", [Item(0, 2, keys[2], [5, 6], keys[1])])
    assert meta.fence_blocks == set(TABLE)  # newly allocated: copies out of them finish first

    shipped = pickle.loads(pickle.dumps(meta))  # vLLM hands the metadata to the workers serialized
    wclient = FakeDaemon()
    w = worker(wclient)
    w.handle_preemptions(shipped)
    w.bind(shipped)
    w.start_load_kv()
    w.wait_for_save()

    assert [s[2:] for s in wclient.kinds("retrieve")] == [(load.items, 77)]
    assert [s[2] for s in wclient.kinds("store")] == [store.items]
    assert [s[2] for s in wclient.kinds("step")] == [1]
    # A load that fails is reported once, in both receiving sets: vLLM recomputes the request.
    wclient.fail(wclient.kinds("retrieve")[0][0])
    _, recving, failed = w.get_transfer_results(set())
    assert recving == failed == {"r1"}


def test_a_finished_request_with_copies_in_flight_frees_its_blocks_after_them(sched: SchedulerSide) -> None:
    client = FakeDaemon()
    connect(sched, client)
    req = Request("r2", list(range(100)), SamplingParams(max_tokens=4), None)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (TABLE,)), 0)
    first = sched.build_connector_meta(scheduler_output(req, computed=0, scheduled=100))
    assert [len(s.items) for s in first.stores] == [3]

    assert sched.request_finished(req, TABLE) == (True, None)  # its store may still be copying
    second = sched.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                     num_computed_tokens=[]),
        num_scheduled_tokens={}, total_num_scheduled_tokens=0, kv_connector_block_state=None))
    assert second.delayed_free == ["r2"] and second.step == 2

    wclient = FakeDaemon()
    w = worker(wclient)
    for meta in (first, second):
        w.handle_preemptions(meta)
        w.bind(meta)
        w.start_load_kv()
        w.wait_for_save()
    assert w.get_finished(set()) == (None, None)  # the store out of its blocks still runs
    wclient.fail(wclient.kinds("store")[0][0])  # done or failed: either way the blocks are free
    assert w.get_finished(set()) == ({"r2"}, None)


def test_metadata_objects_are_independent_and_survive_pickling() -> None:
    a, b = HkvdConnectorMetadata(step=1), HkvdConnectorMetadata(step=2)
    a.loads.append(LoadJob("r", 5, [Item(0, 0, b"k" * 16, [1, 2])], [1, 2],
                           pull=PullSpec("10.0.0.1:7000", [b"k" * 16], 9)))
    a.stores.append(StoreJob("r", [Item(0, 1, b"j" * 16, [3, 4], b"k" * 16)]))
    a.fence_blocks.add(3)
    assert b.loads == [] and b.stores == [] and b.fence_blocks == set()  # no shared defaults
    back = pickle.loads(pickle.dumps(a))
    assert back == a and back.loads[0].pull == PullSpec("10.0.0.1:7000", [b"k" * 16], 9)
    assert item_blocks(back.loads[0].items + back.stores[0].items) == {1, 2, 3, 4}


def test_a_request_whose_lookup_has_not_answered_is_passed_over_and_counted(sched: SchedulerSide) -> None:
    """vLLM skips the request this step (None) and asks again; each pass is a step it waits, counted."""
    client = FakeDaemon(hit=2, lease_id=5, hold_lookups=True)
    connect(sched, client)
    req = Request("r1", list(range(100)), SamplingParams(max_tokens=4), None)
    sched.on_new_request(req)

    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert sched.stats["lookups_deferred"] == 2
    client.answer()
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)
    assert sched.stats["lookups_deferred"] == 2


def hybrid_sched(**cfg: Any) -> SchedulerSide:
    """A scheduler side whose engine has a Mamba group beside full attention, chunks of one block: partial chunks
    (turn ends) are on; no ``prefix_match_unit``."""
    side = SchedulerSide(vllm_config(), kv_cache_config(), ShimConfig(socket_path="/nonexistent/hkvd.sock",
                                                                      chunk_size=BLOCK, **cfg))
    side.ctx.groups = [GroupInfo(0, "full", BLOCK, 0), GroupInfo(1, "mamba", BLOCK, 0)]
    return side


@pytest.mark.parametrize("held", [True, False], ids=["tail_held", "tail_gone"])
def test_a_remembered_turn_end_goes_with_the_lookup_and_is_answered_in_one_round_trip(held: bool) -> None:
    """The positions where earlier turns ended (after the same whole chunks) go with the whole-chunk lookup as
    tails; the daemon's answer, with or without one of them, is final: no probe follows."""
    sched = hybrid_sched()
    client = FakeDaemon(hit=2, lease_id=5, tail_held=held)
    connect(sched, client)
    tokens = list(range(100))
    keys = chunk_keys(tokens, BLOCK)
    sched.ctx.turn_ends.add(keys[1], 7)  # a turn ended 7 tokens into chunk 2 (39 tokens)
    sched.ctx.turn_ends.add(keys[3], 3)  # and one into chunk 4, beyond what this daemon holds
    req = Request("r1", tokens, SamplingParams(max_tokens=4), None)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == ((39 if held else 2 * BLOCK), True)
    [lookup] = client.kinds("lookup")  # one round trip
    assert lookup[2] == keys[:6]
    assert lookup[3] == [(4, partial_key(keys[3], tokens[64:67])), (2, partial_key(keys[1], tokens[32:39]))]


@pytest.mark.parametrize("end,daemon_takes,noted", [(40, True, True), (42, True, False), (40, False, False)],
                         ids=["on_the_unit", "between_units", "older_daemon"])
def test_a_turn_end_on_a_multiple_of_the_unit_goes_with_vllms_partial_note(end: int, daemon_takes: bool,
                                                                          noted: bool) -> None:
    """A turn-end state is stored with the note vLLM gives its own partial entry there (one block of the hash unit,
    ``NoteMaker.partial_note``) when the position is a multiple of the unit and the daemon takes partial notes;
    otherwise without one."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash

    from hkvd.shim.kv_event_notes import NoteMaker
    from hkvd.transport.wire.control import KV_EVENTS_PUBLISHED

    unit = BLOCK // 4
    sched = hybrid_sched()
    sched.stores.notes = NoteMaker(BLOCK, unit)
    client = FakeDaemon(hit=0)
    sched.link.client = client
    sched.link.ack = RegisterAck(0, 1, b"f" * 16, BLOCK, KV_EVENTS_PUBLISHED, lookup_tails=True,
                                 partial_notes=daemon_takes)
    sched.link.generation += 1
    init_none_hash(sha256)
    prompt = list(range(100, 136))
    req = Request("r1", prompt, SamplingParams(max_tokens=8), None, block_hasher=get_request_block_hasher(unit, sha256))
    sched.on_new_request(req)
    req.append_output_token_ids(list(range(200, 200 + end + 1 - len(prompt))))
    req.num_computed_tokens = end  # the last sampled token is not computed yet
    key = sched.stores.store_turn_end(req, sched.ctx.reqs["r1"], [TABLE, TABLE])
    assert key is not None
    (job,) = sched.stores.finish_stores
    assert {it.key for it in job.items} == {key}
    if not noted:
        assert job.notes == []
        return
    (note,) = job.notes
    assert note.key == key and note.hashes == [maybe_convert_block_hash(req.block_hashes[end // unit - 1])]
    assert note.parent == maybe_convert_block_hash(req.block_hashes[end // unit - 2])
    assert len(note.tokens) == 4 * unit


@pytest.mark.parametrize("known", [False, True], ids=["learnt_from_the_daemon", "already_sent"])
def test_a_turn_end_the_daemon_names_is_looked_up_again_once_as_a_tail(known: bool) -> None:
    """A turn end another engine stored: the daemon names it in the reply (LookupReply.ends), and the lookup goes
    once more with it as a tail, which serves; the first lease is released. A position the tails already tried
    brings no second lookup."""
    sched = hybrid_sched()
    client = FakeDaemon(hit=2, lease_id=5, tail_held=True, ends=[[2, 7], [9, 1], [2, 90]])  # 2 bad: dropped
    connect(sched, client, ends=True)
    tokens = list(range(100))
    keys = chunk_keys(tokens, BLOCK)
    if known:
        sched.ctx.turn_ends.add(keys[1], 7)
        client.tail_held = False
    req = Request("r1", tokens, SamplingParams(max_tokens=4), None)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == ((2 * BLOCK, True) if known else (39, True))
    lookups = client.kinds("lookup")
    tail = (2, partial_key(keys[1], tokens[32:39]))
    if known:
        assert [(lk[3], lk[4]) for lk in lookups] == [([tail], True)] and client.released == []
        return
    assert [(lk[3], lk[4]) for lk in lookups] == [([], True), ([tail], False)]
    assert client.released == [5] and sched.stats["lookups_for_turn_ends"] == 1
    assert sched.ctx.turn_ends.positions(keys[1], 2 * BLOCK, 100) == [39]  # remembered for the session's next turn


def test_a_turn_end_is_stored_with_its_offset_for_other_engines() -> None:
    sched = hybrid_sched()
    client = FakeDaemon()
    connect(sched, client, ends=True)
    prompt = list(range(36))
    req = Request("r1", prompt, SamplingParams(max_tokens=8), None)
    sched.on_new_request(req)
    req.append_output_token_ids(list(range(200, 206)))
    req.num_computed_tokens = 41
    assert sched.stores.store_turn_end(req, sched.ctx.reqs["r1"], [TABLE, TABLE]) is not None
    (job,) = sched.stores.finish_stores
    assert job.turn_end == 41 - 2 * BLOCK


def test_a_sampled_request_drops_its_partial_chunk_and_compares_the_whole_chunks_before_it() -> None:
    sched = hybrid_sched(verify_fraction=1.0)
    client = FakeDaemon(hit=2, lease_id=5, tail_held=True)
    connect(sched, client)
    tokens = list(range(100))
    sched.ctx.turn_ends.add(chunk_keys(tokens, BLOCK)[1], 7)
    req = Request("r1", tokens, SamplingParams(max_tokens=4), None)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # computed, not loaded
    st = sched.ctx.reqs["r1"]
    assert (st.verify_from, st.verify_upto) == (0, 2) and st.partial is None


def test_against_a_daemon_that_takes_no_tails_the_turn_end_is_probed_after_the_answer() -> None:
    sched = hybrid_sched()
    client = FakeDaemon(hit=2, lease_id=5)
    connect(sched, client, tails=False)
    tokens = list(range(100))
    sched.ctx.turn_ends.add(chunk_keys(tokens, BLOCK)[1], 7)
    req = Request("r1", tokens, SamplingParams(max_tokens=4), None)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * BLOCK, True)  # the probe hits 2 (scripted): a miss
    keys = chunk_keys(tokens, BLOCK)
    assert [(x[2], x[3]) for x in client.kinds("lookup")] == [(keys, []),  # no tails, then one probe
                                                              ([*keys[:2], partial_key(keys[1], tokens[32:39])], [])]


class Clock:
    """``time.monotonic`` for the scheduler side, moved by the test and by each poll's timeout (a poll that
    finds nothing waits its whole timeout, as a socket poll does)."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


class WaitedLookups(FakeDaemon):
    def __init__(self, clock: Clock) -> None:
        super().__init__(hit=2, lease_id=5, hold_lookups=True)
        self.clock = clock
        self.waits: list[float] = []

    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        if timeout_s > 0:
            self.waits.append(timeout_s)
            self.clock.now += timeout_s
        return super().poll(timeout_s)


def step(sched: SchedulerSide, clock: Clock, after_s: float, scheduled: int) -> None:
    clock.now += after_s
    sched.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                     num_computed_tokens=[]),
        num_scheduled_tokens={}, total_num_scheduled_tokens=scheduled, kv_connector_block_state=None))


def test_the_lookup_wait_follows_the_engine_step_within_its_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    """lookup_wait_fraction of the longest of the last four steps, at least lookup_wait_s, at most
    lookup_wait_max_s; a step that scheduled nothing is not the engine's pace."""
    clock = Clock()
    monkeypatch.setattr("hkvd.shim.lookups.time", clock)
    sched = SchedulerSide(vllm_config(), kv_cache_config(), ShimConfig(
        socket_path="/nonexistent/hkvd.sock", chunk_size=CHUNK, lookup_wait_s=0.002, lookup_wait_fraction=0.05,
        lookup_wait_max_s=0.025))
    assert sched.lookup_wait_budget() == 0.002  # no step seen yet
    step(sched, clock, 0.0, scheduled=100)
    step(sched, clock, 0.2, scheduled=100)
    assert sched.lookup_wait_budget() == pytest.approx(0.01)
    for _ in range(3):  # short decode steps after a long prefill: the prefill still counts
        step(sched, clock, 0.01, scheduled=100)
    assert sched.lookup_wait_budget() == pytest.approx(0.01)
    step(sched, clock, 0.01, scheduled=100)  # four short steps since: the floor
    assert sched.lookup_wait_budget() == 0.002
    step(sched, clock, 0.01, scheduled=0)
    step(sched, clock, 5.0, scheduled=100)  # after a step of nothing (the engine loops at once): no interval
    assert sched.lookup_wait_budget() == 0.002
    step(sched, clock, 2.0, scheduled=100)
    assert sched.lookup_wait_budget() == 0.025  # 0.05 * 2.0 = 0.1, capped


def test_the_lookup_wait_options_refuse_bad_values_by_name() -> None:
    for key, bad in (("lookup_wait_fraction", 1.5), ("lookup_wait_fraction", "nan"), ("lookup_wait_max_s", -1),
                     ("lookup_wait_s", "nan")):
        with pytest.raises(ValueError, match=f"hkvd: {key} must be"):
            ShimConfig.from_extra({key: bad})
    assert ShimConfig.from_extra({"lookup_wait_fraction": 0}).lookup_wait_fraction == 0.0


def test_lookups_of_one_scheduling_share_its_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """With 0.2-second steps one scheduling may wait 10 ms for replies: the first lookup not answered takes
    it, the next waits lookup_wait_s only; the next scheduling has its own."""
    clock = Clock()
    monkeypatch.setattr("hkvd.shim.lookups.time", clock)
    sched = SchedulerSide(vllm_config(), kv_cache_config(), ShimConfig(
        socket_path="/nonexistent/hkvd.sock", chunk_size=CHUNK, lookup_wait_s=0.002, lookup_wait_fraction=0.05,
        lookup_wait_max_s=0.025))
    client = WaitedLookups(clock)
    connect(sched, client)
    step(sched, clock, 0.0, scheduled=100)
    step(sched, clock, 0.2, scheduled=100)
    a = Request("a", list(range(100)), SamplingParams(max_tokens=4), None)
    b = Request("b", list(range(1000, 1100)), SamplingParams(max_tokens=4), None)
    sched.on_new_request(a)
    sched.on_new_request(b)

    assert sched.get_num_new_matched_tokens(a, 0) == (None, False)
    assert sum(client.waits) == pytest.approx(0.01)
    client.waits.clear()
    assert sched.get_num_new_matched_tokens(b, 0) == (None, False)
    assert sum(client.waits) == pytest.approx(0.002)
    assert sched.stats["lookups_deferred"] == 2

    step(sched, clock, 0.2, scheduled=100)  # 0.212 s: the waits were part of the step
    client.waits.clear()
    assert sched.get_num_new_matched_tokens(a, 0) == (None, False)
    assert sum(client.waits) == pytest.approx(0.05 * 0.212)


def test_an_invalid_transition_raises_under_strict_and_otherwise_recomputes_the_request(
        sched: SchedulerSide, caplog: pytest.LogCaptureFixture) -> None:
    client = FakeDaemon(hit=2, lease_id=77)
    connect(sched, client)
    req = Request("r1", list(range(100)), SamplingParams(max_tokens=4), None)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)
    # A load reported for a request whose blocks were never allocated: a bug, or vLLM changed its order.
    sched.strict = True
    with pytest.raises(InvalidTransition):
        sched.update_connector_output(SimpleNamespace(finished_recving={"r1"}, failed_recving=None))
    assert sched.ctx.reqs["r1"].state is State.LOOKED_UP
    sched.strict = False
    with caplog.at_level(logging.DEBUG, "hkvd.shim"):
        for _ in range(2):
            output = SimpleNamespace(finished_recving={"r1"}, failed_recving=None)
            sched.update_connector_output(output)
            assert output.finished_recving == {"r1"}  # vLLM's own view is untouched
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "no transition from 'looked up' on 'load reported finished'" in errors[0].message
    assert client.released == [77]  # the lease it will never load under is given back
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # recomputed, never loaded


def test_a_load_planned_in_an_invalid_state_reaches_the_worker_empty_and_fails(sched: SchedulerSide) -> None:
    client = FakeDaemon(hit=2, lease_id=77)
    connect(sched, client)
    req = Request("r1", list(range(100)), SamplingParams(max_tokens=4), None)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)
    blocks = SimpleNamespace(get_block_ids=lambda: (TABLE,))
    sched.update_state_after_alloc(req, blocks, 2 * CHUNK)
    sched.update_state_after_alloc(req, blocks, 2 * CHUNK)  # again while it loads: vLLM never does
    meta = sched.build_connector_meta(scheduler_output(req, computed=2 * CHUNK, scheduled=0))
    assert [len(j.items) for j in meta.loads] == [2, 0]  # the second is refused: vLLM still waits for it
    w = worker(FakeDaemon())
    w.bind(meta)
    w.start_load_kv()
    _, recving, failed = w.get_transfer_results(set())
    assert recving == failed == {"r1"}
    sched.update_connector_output(SimpleNamespace(finished_recving=recving, failed_recving=failed))
    assert sched.ctx.reqs["r1"].state is State.FAILED
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)


def test_a_sampled_hit_is_computed_and_its_chunks_are_verified_where_they_would_be_stored() -> None:
    """verify_fraction 1: the hit of chunks 0-1 is reported as no external tokens, its lease released; the
    step that computes the prompt sends chunks 0-1 as one Verify (the request's own blocks) and stores chunk 2."""
    from hkvd.transport.wire.kv import StoreResult

    sched = SchedulerSide(vllm_config(), kv_cache_config(), ShimConfig(socket_path="/nonexistent/hkvd.sock",
                                                                       chunk_size=CHUNK, verify_fraction=1.0))
    client = FakeDaemon(hit=2, lease_id=77)
    connect(sched, client)
    req = Request("r1", list(range(100)), SamplingParams(max_tokens=4), None)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # computed, not loaded
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)  # repeatable, as vLLM may ask again
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (TABLE,)), 0)
    assert client.released == [77] and sched.stats["verify_sampled"] == 1
    meta = sched.build_connector_meta(scheduler_output(req, computed=0, scheduled=100))
    keys = client.kinds("lookup")[0][2]
    assert meta.loads == []
    [check] = meta.verifies
    assert (check.req_id, check.items) == ("r1", [Item(0, 0, keys[0], [1, 2]), Item(0, 1, keys[1], [3, 4], keys[0])])
    [store] = meta.stores
    assert store.items == [Item(0, 2, keys[2], [5, 6], keys[1])]  # past the hit: stored as usual

    assert sched.request_finished(req, TABLE) == (True, None)  # its blocks wait for the Verify's read
    wclient = FakeDaemon()
    w = worker(wclient)
    shipped = pickle.loads(pickle.dumps(meta))
    w.bind(shipped)
    w.wait_for_save()
    w.bind(HkvdConnectorMetadata(step=2, delayed_free=["r1"]))
    [(vid, _, items)] = wclient.kinds("verify")
    assert items == check.items
    store_id = wclient.kinds("store")[0][0]
    wclient.complete(store_id, result=StoreResult(store_id, 4096, 1, 0, 0, 0))
    assert w.get_finished(set()) == (None, None)  # the daemon still reads its blocks for the comparison
    wclient.fail(vid)  # a daemon without verification answers an error: counted, the request unaffected
    assert w.get_finished(set()) == ({"r1"}, None)
    assert w.transfer_totals()["verifies_failed"] == 1 and w.link.client is wclient  # the link stays up


@pytest.mark.parametrize("why", ["not sampled", "an older daemon"])
def test_a_hit_that_is_not_sampled_is_loaded_and_never_verified(why: str, caplog: pytest.LogCaptureFixture) -> None:
    """A hit outside the sample is loaded; so is every hit against a daemon whose RegisterAck does not say it
    compares (it could not parse a Verify: an unknown message fails the connection's every request)."""
    fraction = 0.0 if why == "not sampled" else 1.0
    sched = SchedulerSide(vllm_config(), kv_cache_config(), ShimConfig(socket_path="/nonexistent/hkvd.sock",
                                                                       chunk_size=CHUNK, verify_fraction=fraction))
    client = FakeDaemon(hit=2, lease_id=77)
    connect(sched, client, verify=why == "not sampled")
    req = Request("r1", list(range(100)), SamplingParams(max_tokens=4), None)
    sched.on_new_request(req)
    assert sched.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, True)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (TABLE,)), 2 * CHUNK)
    meta = sched.build_connector_meta(scheduler_output(req, computed=2 * CHUNK, scheduled=100 - 2 * CHUNK))
    assert meta.verifies == [] and len(meta.loads) == 1 and client.released == []
    assert ("upgraded" in caplog.text) == (why == "an older daemon")


def pinned(req_id: str, params: Any, hit: int = 0, **kw: Any) -> tuple[SchedulerSide, FakeDaemon, Request]:
    """A scheduler side with a pinned request that arrived, was allocated and computed its whole prompt."""
    sched = SchedulerSide(vllm_config(), kv_cache_config(), ShimConfig(socket_path="/nonexistent/hkvd.sock",
                                                                       chunk_size=CHUNK, verify_fraction=0.0))
    client = FakeDaemon(hit=hit, lease_id=5 if hit else 0)
    connect(sched, client, pins=kw.pop("pins", True))
    req = Request(req_id, list(range(100)), SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params}),
                  None, **kw)
    sched.on_new_request(req)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (TABLE,)), hit * CHUNK)
    return sched, client, req


PIN = {"hkvd": {"pin_s": 300, "session": "chat-7"}}


def test_a_pinned_salted_request_stores_under_its_tenant_and_pins_its_chunks_when_it_finishes() -> None:
    from hkvd.shim.tenants import tenant

    sched, client, req = pinned("r1", PIN, cache_salt="acme-secret")
    label = tenant(req)
    assert label.startswith("salt:") and "acme" not in label
    keys = client.kinds("lookup")[0][2]
    # On arrival, its prompt's whole chunks (100 tokens: 3 of CHUNK), before any is stored.
    assert client.kinds("pin") == [(0, "pin", "chat-7", label, 300.0, keys[:3])]
    meta = sched.build_connector_meta(scheduler_output(req, computed=0, scheduled=100))
    assert [s.tenant for s in meta.stores] == [label]
    sched.request_finished(req, TABLE)
    assert client.kinds("pin")[1:] == [(0, "pin", "chat-7", label, 300.0, keys[:3])]  # every chunk it stored
    assert sched.stats["pins_sent"] == 2

    for pins in (True, False):  # the worker sends the tenant only to a daemon that keeps quotas
        wclient = FakeDaemon()
        w = worker(wclient)
        w.link.ack = RegisterAck(0, 1, b"f" * 16, CHUNK, 0, pins=pins)
        w.bind(pickle.loads(pickle.dumps(meta)))
        w.wait_for_save()
        assert [s[3] for s in wclient.kinds("store")] == [label if pins else ""]


def test_a_pinned_request_whose_chunks_were_all_stored_already_is_still_pinned() -> None:
    """Its prompt's three chunks were a hit: nothing is stored, the Pin names them."""
    sched, client, req = pinned("r1", PIN, hit=3)
    meta = sched.build_connector_meta(scheduler_output(req, computed=3 * CHUNK, scheduled=100 - 3 * CHUNK))
    assert meta.stores == []
    sched.request_finished(req, TABLE)
    assert [p[2:5] for p in client.kinds("pin")] == [("chat-7", "", 300.0)] * 2  # arrival, finish
    assert client.kinds("pin")[1][5] == client.kinds("lookup")[0][2][:3]


def test_a_salted_requests_offered_states_go_out_under_its_tenant() -> None:
    """A state vLLM offers at a block boundary (a Mamba state, in a hybrid) counts against its request's tenant:
    the metadata names it, and the worker sends one tenant per offer to a daemon that takes them."""
    from hkvd.shim.tenants import tenant

    sched, _, req = pinned("r1", {}, cache_salt="acme-secret")
    plain = Request("r2", list(range(1000, 1100)), SamplingParams(max_tokens=4), None)
    sched.on_new_request(plain)
    so = scheduler_output(req, computed=0, scheduled=100)
    offers = {"r1": [(0, 5, CHUNK)], "r2": [(0, 6, CHUNK)]}
    so.kv_connector_block_state = SimpleNamespace(get_block_ids=lambda r: (TABLE,), boundary_state_offloads=offers)
    meta = sched.build_connector_meta(so)
    assert [r for r, _ in meta.offers] == ["r1", "r2"] and meta.offer_tenants == {"r1": tenant(req)}

    for takes in (True, False):
        wclient = FakeDaemon()
        w = worker(wclient)
        w.link.ack = RegisterAck(0, 1, b"f" * 16, CHUNK, 0, pins=True, step_tenants=takes)
        shipped = pickle.loads(pickle.dumps(meta))
        w.handle_preemptions(shipped)
        w.bind(shipped)
        w.start_load_kv()
        w.wait_for_save()
        [step_event] = wclient.kinds("step")
        assert step_event[-1] == ([tenant(req), ""] if takes else []), takes


def test_pins_against_a_daemon_that_takes_none_are_said_once(caplog: pytest.LogCaptureFixture) -> None:
    sched, client, req = pinned("r1", PIN, pins=False)
    sched.build_connector_meta(scheduler_output(req, computed=0, scheduled=100))
    with caplog.at_level(logging.WARNING, logger="hkvd.shim"):
        sched.request_finished(req, TABLE)
        req2 = Request("r2", list(range(100)), SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": PIN}),
                       None)
        sched.on_new_request(req2)
        sched.get_num_new_matched_tokens(req2, 0)
        sched.update_state_after_alloc(req2, SimpleNamespace(get_block_ids=lambda: (TABLE,)), 0)
        sched.build_connector_meta(scheduler_output(req2, computed=0, scheduled=100))
        sched.request_finished(req2, TABLE)
    assert client.kinds("pin") == [] and sched.stats["pins_sent"] == 0
    said = [r for r in caplog.records if "session pins" in r.getMessage()]
    assert len(said) == 1 and "takes none" in said[0].getMessage()


def test_a_bad_pin_runs_the_request_unpinned_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="hkvd.shim"):
        sched, client, req = pinned("r1", {"hkvd": {"pin_s": 300, "session": "has space"}, "do_remote_decode": False})
    warned = [r.getMessage() for r in caplog.records if "kv_transfer_params" in r.getMessage()]
    assert len(warned) == 1 and "runs unpinned" in warned[0] and "session" in warned[0] and "r1" in warned[0]
    meta = sched.build_connector_meta(scheduler_output(req, computed=0, scheduled=100))
    assert [len(s.items) for s in meta.stores] == [3]  # cached as usual
    assert sched.request_finished(req, TABLE) == (True, None)
    assert client.kinds("pin") == [] and sched.stats["pins_refused"] == 1


def test_an_in_step_hit_is_synchronous_copied_before_the_forward_and_its_lease_released_after(tmp_path) -> None:
    """With ``in_step_loads`` and a reply that places the hit in the daemon's pool, vLLM hears a synchronous load;
    the worker copies the entries from its map of the pool in ``handle_preemptions``, submits no Retrieve and
    reports nothing; the lease is released once a later step's output is in."""
    import os

    import numpy as np

    from hkvd.transport import layout
    from hkvd.transport.copy_engine import Region

    cfg = ShimConfig(socket_path="/nonexistent/hkvd.sock", chunk_size=CHUNK, in_step_loads=True)
    side = SchedulerSide(vllm_config(), kv_cache_config(), cfg)
    page = kv_cache_config().kv_cache_groups[0].kv_cache_spec.page_size_bytes
    entry = 2 * page  # two blocks, one layer
    client = FakeDaemon(hit=2, lease_id=77, server_id="daemon-1")
    client.places = [[[0, 0, [entry, entry]], [0, 1, [0, entry]]]]  # rank 0: chunk 1 first in the pool
    connect(side, client)
    side.link.ack = RegisterAck(0, 1, b"f" * 16, side.chunk_size, 0, verify=True, lookup_tails=True, in_step=True)
    req = Request("r9", list(range(100)), SamplingParams(max_tokens=4), None)

    side.on_new_request(req)
    assert client.kinds("lookup") and side.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, False)
    side.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (TABLE,)), 2 * CHUNK)
    assert side.ctx.reqs["r9"].state is State.RUNNING  # vLLM runs it in this very step
    meta = side.build_connector_meta(scheduler_output(req, computed=2 * CHUNK, scheduled=100 - 2 * CHUNK))
    [load] = meta.loads
    assert (load.lease_id, load.places, load.pool, load.block_ids) == (77, client.places, "daemon-1", [1, 2, 3, 4])

    fd = os.memfd_create("hkvd-test-pool", os.MFD_CLOEXEC)
    try:
        pool = np.random.default_rng(3).integers(0, 256, 4 * entry, dtype=np.uint8)
        os.pwrite(fd, pool.tobytes(), 0)
        kv = np.zeros(page * BLOCKS, dtype=np.uint8)
        wclient = FakeDaemon(server_id="daemon-1")
        w = worker(wclient)
        w.in_step.maps.map(os.getpid(), "daemon-1", [fd, pool.nbytes])
        region = Region(0, "host", kv.nbytes, int(kv.ctypes.data))
        view = layout.View(0, 0, 1, page * BLOCKS, page, page)  # one layer, block b at b * page
        w.in_step._layout = ({0: layout.GroupSpec(0, "full", BLOCK, 0, BLOCKS, "float16", (view,))}, {0: region}, 0)
        shipped = pickle.loads(pickle.dumps(meta))
        w.handle_preemptions(shipped)
        assert not kv.any()  # attention blocks wait for start_load_kv (vLLM zeroes a sync load's blocks between)
        w.bind(shipped)
        w.start_load_kv()
        # Chunk 0 (blocks 1, 2) from the pool's second entry, chunk 1 (blocks 3, 4) from its first.
        assert np.array_equal(kv[page:3 * page], pool[entry:2 * entry])
        assert np.array_equal(kv[3 * page:5 * page], pool[:entry])
        assert not kv[:page].any() and not kv[5 * page:].any()
        assert wclient.kinds("retrieve") == []
        assert w.get_transfer_results(set())[1:] == (set(), set())
        assert w.get_block_ids_with_load_errors() == set() and w.in_step.stats["in_step_loads"] == 1
    finally:
        w.in_step.maps.close()
        os.close(fd)

    output = SimpleNamespace(finished_recving=None, failed_recving=None, finished_sending=None)
    side.update_connector_output(output)
    assert client.released == []  # the metadata that carried it was built last: it may not have run yet
    side.build_connector_meta(scheduler_output(req, computed=100, scheduled=1))
    side.update_connector_output(output)
    assert client.released == [77]


def test_hkvd_logs_where_vllm_logs_unless_logging_is_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM leaves the root logger without handlers: hkvd's INFO lines would reach no one. The connector gives
    the ``hkvd`` logger vLLM's handlers and level then, and leaves a configured root logger alone."""
    from hkvd.shim.connector import log_where_vllm_logs

    ours, vllm_logger, root = logging.getLogger("hkvd"), logging.getLogger("vllm"), logging.getLogger()
    handler = logging.StreamHandler()
    monkeypatch.setattr(vllm_logger, "handlers", [handler])
    monkeypatch.setattr(vllm_logger, "level", logging.DEBUG)
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    monkeypatch.setattr(root, "handlers", [logging.NullHandler()])  # configured (here: by pytest)
    log_where_vllm_logs()
    assert ours.handlers == [] and ours.level == logging.NOTSET
    monkeypatch.setattr(root, "handlers", [])
    log_where_vllm_logs()
    assert ours.handlers == [handler] and ours.level == logging.DEBUG
    log_where_vllm_logs()  # once only
    assert ours.handlers == [handler]
