"""Hybrid models end to end: one int8 buffer with a full-attention group and three Mamba groups
aliasing it (padded Mamba pages), boundary states offered by step events and confirmed by the
engine, retrieved by another process; and a sliding-window engine that loads only the window."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, fetch_in_child, prompt_tokens
from hkvd.transport.errors import RegistrationError
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire.kv import Item

BLOCK = 16  # tokens per block == chunk size (N), as recommended for Mamba hybrids
ATTN_PAGE = 8192
MAMBA_PAGE = 5000  # padded up to ATTN_PAGE inside the shared buffer
SHAPES = [GroupShape("full", 2, ATTN_PAGE)] + [GroupShape("mamba", 2, MAMBA_PAGE, ATTN_PAGE)] * 3
KW = {"num_blocks": 128, "tokens_per_block": BLOCK, "chunk_size": BLOCK, "aliased": True}
MAMBA = (1, 2, 3)


class StepDriver:
    """Plays an engine's steps: one chunk per step, attention stores, Mamba offers with confirms."""

    def __init__(self, eng: SyntheticEngine) -> None:
        self.eng = eng
        self.seq = 0
        self.unconfirmed: list[int] = []

    def step(self, step: int, offers: list[Item], stores: list[Item]) -> int:
        c = self.eng.client
        if stores:
            self.eng.store(stores)
        # Confirm what we saw finish before this step could reuse a block (the shim's fence).
        done = c.wait(self.unconfirmed, 10.0) if self.unconfirmed else {}
        confirms = [rid for rid, comp in done.items() if comp.ok]
        req = c.submit_step_event(self.seq, step, offers, confirms)
        self.seq += 1
        self.unconfirmed = [req]
        return req

    def finish(self, step: int) -> None:
        self.step(step, [], [])
        self.eng.run(self.unconfirmed[0])
        self.unconfirmed = []


def store_prompt(eng: SyntheticEngine, keys: list[bytes], *, confirm: bool = True) -> dict:
    """Chunk i -> attention block 1+i; Mamba group g state after chunk i -> block 40+10*g+i."""
    drv = StepDriver(eng)
    written: dict = {}
    for i, key in enumerate(keys):
        attn = Item(0, i, key, [1 + i])
        eng.fill_random(0, attn.block_ids, seed=100 + i)
        offers = []
        for g in MAMBA:
            blk = 40 + 10 * g + i
            eng.fill_random(g, [blk], seed=1000 * g + i)
            offers.append(Item(g, i, key, [blk]))
            written[(g, i)] = eng.block_bytes(g, blk)
        written[(0, i)] = eng.block_bytes(0, 1 + i)
        drv.step(i, offers, [attn])
    if confirm:
        drv.finish(len(keys))
    return written


def child_fetch(socket_path: str, keys: list[bytes], items: list[Item]) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=fetch_in_child, args=(socket_path, SHAPES, KW, keys, items, q))
    p.start()
    try:
        res = q.get(timeout=60)
    finally:
        p.join(30)
    assert "error" not in res, res.get("error")
    return res


def test_hybrid_store_across_steps_and_retrieve_in_another_process(daemon):
    eng = SyntheticEngine(daemon.socket_path, SHAPES, **KW)
    keys = chunk_keys(prompt_tokens(BLOCK * 5, seed=21), BLOCK)
    written = store_prompt(eng, keys)
    n = len(keys)
    # The hit at L = 5 chunks needs attention chunks 0..4 and each Mamba group's state at exactly 5*16.
    items = [Item(0, i, keys[i], [60 + i]) for i in range(n)]
    items += [Item(g, n - 1, keys[n - 1], [90 + g]) for g in MAMBA]  # the state goes to index L/bs - 1
    res = child_fetch(daemon.socket_path, keys, items)
    assert res["hit_chunks"] == n
    for i in range(n):
        assert res["blocks"][(0, 60 + i)] == written[(0, i)]
    for g in MAMBA:
        assert res["blocks"][(g, 90 + g)] == written[(g, n - 1)]
    # Padding between Mamba pages is never written: only page_bytes of each block are copied.
    eng.close()


def test_unconfirmed_states_are_never_served(daemon):
    eng = SyntheticEngine(daemon.socket_path, SHAPES, **KW)
    keys = chunk_keys(prompt_tokens(BLOCK * 3, seed=22), BLOCK)
    store_prompt(eng, keys, confirm=False)
    # Chunks 0 and 1 were confirmed by the following steps' events; chunk 2's state was not.
    probe = SyntheticEngine(daemon.socket_path, SHAPES, **KW)
    assert probe.lookup(keys, lease=False)[0] == 2
    # The engine disconnects without confirming: the pending state is dropped, never served.
    eng.close()
    assert probe.lookup(keys, lease=False)[0] == 2
    assert daemon.status()["index"]["pending"] == 0
    probe.close()


def test_a_gap_in_step_events_invalidates_pending_states(daemon):
    eng = SyntheticEngine(daemon.socket_path, SHAPES, **KW)
    keys = chunk_keys(prompt_tokens(BLOCK * 2, seed=23), BLOCK)
    c = eng.client
    offers = [Item(g, 0, keys[0], [40 + g]) for g in MAMBA]
    eng.store([Item(0, 0, keys[0], [1])])
    first = c.submit_step_event(0, 0, offers, [])
    eng.run(first)
    # seq 1 is lost; seq 2 arrives carrying the confirm: too late, the gap already invalidated it.
    eng.run(c.submit_step_event(2, 1, [], [first]))
    assert eng.lookup(keys, lease=False)[0] == 0
    assert daemon.status()["counters"]["step_event_gaps"] == 1
    eng.close()


def test_mamba_hit_needs_the_state_at_exactly_the_boundary(daemon):
    eng = SyntheticEngine(daemon.socket_path, SHAPES, **KW)
    keys = chunk_keys(prompt_tokens(BLOCK * 4, seed=24), BLOCK)
    drv = StepDriver(eng)
    for i, key in enumerate(keys):  # attention for every chunk, Mamba states only at chunk 1
        offers = [Item(g, i, key, [40 + g]) for g in MAMBA] if i == 1 else []
        drv.step(i, offers, [Item(0, i, key, [1 + i])])
    drv.finish(len(keys))
    assert eng.lookup(keys, lease=False)[0] == 2  # never rounded up to 4
    eng.close()


def test_one_missing_mamba_group_limits_the_hit(daemon):
    eng = SyntheticEngine(daemon.socket_path, SHAPES, **KW)
    keys = chunk_keys(prompt_tokens(BLOCK * 2, seed=25), BLOCK)
    drv = StepDriver(eng)
    drv.step(0, [Item(g, 0, keys[0], [40 + g]) for g in MAMBA], [Item(0, 0, keys[0], [1])])
    drv.step(1, [Item(g, 1, keys[1], [50 + g]) for g in MAMBA[:2]], [Item(0, 1, keys[1], [2])])
    drv.finish(2)
    assert eng.lookup(keys, lease=False)[0] == 1
    eng.close()


def test_sliding_window_engine_needs_and_loads_only_the_window(daemon):
    shapes = [GroupShape("full", 1, 4096), GroupShape("swa", 2, 4096, window_tokens=32)]
    kw = {"num_blocks": 64, "tokens_per_block": 16, "chunk_size": 16}
    eng = SyntheticEngine(daemon.socket_path, shapes, **kw)
    keys = chunk_keys(prompt_tokens(16 * 6, seed=26), 16)
    eng.store([Item(0, i, k, [1 + i]) for i, k in enumerate(keys)])
    eng.fill_random(1, [20, 21], seed=5)
    want = [eng.block_bytes(1, 20), eng.block_bytes(1, 21)]
    eng.store([Item(1, 4, keys[4], [20]), Item(1, 5, keys[5], [21])])  # only the last 32 tokens
    hit, lease = eng.lookup(keys)
    assert hit == 6
    eng.zero(1, [30, 31])
    eng.retrieve([Item(1, 4, keys[4], [30]), Item(1, 5, keys[5], [31])], lease)
    assert [eng.block_bytes(1, 30), eng.block_bytes(1, 31)] == want
    # The window at L = 4 chunks would need chunks 2 and 3, which were never stored.
    assert eng.lookup(keys[:4], lease=False)[0] == 0
    eng.close()


def test_layouts_never_mix_across_hybrid_engines(daemon):
    eng = SyntheticEngine(daemon.socket_path, SHAPES, **KW)
    keys = chunk_keys(prompt_tokens(BLOCK * 2, seed=27), BLOCK)
    store_prompt(eng, keys)
    other = SyntheticEngine(daemon.socket_path, SHAPES, **{**KW, "layout_tag": "cuda/BLHNC"})
    assert other.lookup(keys, lease=False)[0] == 0
    other.close()
    eng.close()


def test_mamba_without_align_mode_is_refused_with_the_fix(daemon):
    with pytest.raises(RegistrationError, match="align"):
        SyntheticEngine(daemon.socket_path, SHAPES, **{**KW, "mamba_cache_mode": "none"})


def test_mamba_checkpoint_interval_keeps_every_kth_state_and_reports_savings(daemon_factory):
    d = daemon_factory("--l1-size-gb", "0.125", "--chunk-size", "16", "--mamba-checkpoint-interval", "2")
    eng = SyntheticEngine(d.socket_path, SHAPES, **KW)
    keys = chunk_keys(prompt_tokens(BLOCK * 4, seed=28), BLOCK)
    store_prompt(eng, keys)
    st = d.status()
    # States after chunks 2 and 4 (indices 1 and 3) kept; 1 and 3 dropped, for each of 3 groups.
    assert st["counters"]["mamba_states_thinned"] == 6
    assert st["counters"]["mamba_bytes_saved"] == 6 * 2 * MAMBA_PAGE
    assert eng.lookup(keys, lease=False)[0] == 4
    assert eng.lookup(keys[:3], lease=False)[0] == 2  # nearest kept boundary below, never above
    eng.close()


@pytest.mark.parametrize("policy", ["lru", "hybrid"])
def test_evicting_an_attention_chunk_drops_its_orphaned_mamba_states(daemon_factory, policy):
    # A 64 MiB pool; entries of 16 KiB (attention) and 10 KB (Mamba states).
    d = daemon_factory("--l1-size-gb", "0.0625", "--chunk-size", "16", "--eviction-policy", policy)
    eng = SyntheticEngine(d.socket_path, SHAPES, **KW)
    keys = chunk_keys(prompt_tokens(BLOCK * 2, seed=29), BLOCK)
    store_prompt(eng, keys)
    # Flood with attention-only prefixes of another engine layout until eviction starts and goes on.
    flood = SyntheticEngine(d.socket_path, [GroupShape("full", 2, 512 << 10)], num_blocks=64, chunk_size=16,
                            tokens_per_block=16)
    for seed in range(400):
        k = chunk_keys(prompt_tokens(16, seed=10_000 + seed), 16)
        flood.store([Item(0, 0, k[0], [1])])
    st = d.status()
    assert st["index"]["evictions"] > 0
    # Wherever an attention chunk of the hybrid prompt went, its Mamba states went with it: no
    # Mamba state is left whose own attention chunk is gone.
    assert eng.lookup(keys, lease=False)[0] == 0
    assert st["index"]["by_kind"].get("mamba", 0) == 0
    assert st["index"]["orphans_dropped"] > 0
    flood.close()
    eng.close()
