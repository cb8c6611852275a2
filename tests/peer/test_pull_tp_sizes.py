"""Pulls across tensor-parallel sizes between two real daemons (NIXL over TCP): a prefill world of one TP size
stores on the serving daemon, a decode engine of another TP size pulls through its own daemon, and each decode
rank loads exactly its own KV heads (and GDN states), re-sharded from the source ranks' entries
(daemon/peers/tp_pulls.py).

The synthetic model, its per-rank pages and the NumPy reference are tests/e2e/test_tensor_parallel_sizes.py's
(loaded by path). A shape the decode daemon cannot re-shard, or ``--tp-reshard off`` there, is a miss (hit 0)
and one log line naming why.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from hkvd.shim.testing.synthetic import SyntheticEngine, prompt_tokens
from hkvd.transport.keys import chunk_keys


def _load_tp() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "e2e" / "test_tensor_parallel_sizes.py"
    spec = importlib.util.spec_from_file_location("hkvd_test_tp_sizes_helpers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tp = _load_tp()


def pull(eng: SyntheticEngine, peer: str, keys: list[bytes], timeout_s: float = 60.0) -> Any:
    rid = eng.client.submit_pull(peer, keys)
    c = eng.client.wait([rid], timeout_s)[rid]
    if c.error is not None:
        raise c.error
    return c.result


def entries_per_rank(keys: list[bytes], chunk: int) -> int:
    """Entries a hit of every chunk of ``keys`` needs on one source rank: every full chunk, the window's swa."""
    n = len(keys)
    return n + sum(1 for i in range(n) if (i + 1) * chunk > n * chunk - tp.WINDOW)


def test_tp2_prefill_to_tp1_decode_reads_both_source_ranks(pair: Any) -> None:
    prefill, decode = pair
    writers = tp.world(prefill, 2)
    c = writers[0].chunk_size
    keys = chunk_keys(prompt_tokens(c * 3, seed=21), c)
    kv = tp.model_kv(keys)
    tp.store(writers, keys, kv)
    for w in writers:
        w.close()  # the prefill engines may be gone: their daemon still serves the entries

    (reader,) = tp.world(decode, 1)
    res = pull(reader, prefill.peer_address, keys)
    per_rank = entries_per_rank(keys, c)
    assert (res.hit_chunks, res.pulled, res.local) == (3, 2 * per_rank, 0), res
    reader.retrieve(tp.items(reader, keys, first=9, hit=True), res.lease_id)
    tp.check_loaded(reader, keys, kv, first=9)

    again = pull(reader, prefill.peer_address, keys)  # everything is here: nothing moves
    assert (again.hit_chunks, again.pulled, again.nbytes) == (3, 0, 0), again
    reader.client.release(again.lease_id)
    d = decode.status()
    assert d["index"]["writing"] == 0 and d["index"]["ready"] == 2 * per_rank
    assert d["peer"]["transport"]["reads_failed"] == 0
    reader.close()


def test_tp1_prefill_to_tp2_decode_moves_each_source_entry_once(pair: Any) -> None:
    prefill, decode = pair
    (writer,) = tp.world(prefill, 1)
    c = writer.chunk_size
    keys = chunk_keys(prompt_tokens(c * 2, seed=22), c)
    kv = tp.model_kv(keys)
    tp.store([writer], keys, kv)

    readers = tp.world(decode, 2)
    per_rank = entries_per_rank(keys, c)
    first = pull(readers[0], prefill.peer_address, keys)
    assert (first.hit_chunks, first.pulled) == (2, per_rank) and first.nbytes > 0, first
    second = pull(readers[1], prefill.peer_address, keys)  # the same source entries: found on this node
    assert (second.hit_chunks, second.pulled, second.nbytes) == (2, 0, 0), second
    for r, res in zip(readers, (first, second), strict=True):
        r.retrieve(tp.items(r, keys, first=5, hit=True), res.lease_id)
        tp.check_loaded(r, keys, kv, first=5)
    d = decode.status()
    assert d["index"]["ready"] == per_rank and d["peer"]["transport"]["reads"] >= 1
    for e in (writer, *readers):
        e.close()


def test_the_hit_is_what_every_needed_source_rank_holds(pair: Any) -> None:
    """Rank 1 of the TP=2 prefill world stored 2 of the 3 chunks: the TP=1 decode engine's hit is 2, and rank 0,
    first READ for a hit of 3, is looked up again for 2 (the sliding window's entries end at the hit: chunk 0's
    is needed now), so the load is exact."""
    prefill, decode = pair
    writers = tp.world(prefill, 2)
    c = writers[0].chunk_size
    keys = chunk_keys(prompt_tokens(c * 3, seed=24), c)
    kv = tp.model_kv(keys)
    tp.store(writers, keys[:2], kv)  # both ranks: chunks 0 and 1
    w0 = writers[0]
    page = w0.groups[0].views[0].page_bytes
    last = [it for it in tp.items(w0, keys) if it.chunk_index == 2]  # rank 0 alone: chunk 2
    for it in last:
        for i, b in enumerate(it.block_ids):
            data = np.frombuffer(tp.rank_block(kv[(it.group_id, 2, i)], 2, 0), np.int8)
            for layer in range(tp.LAYERS):
                w0.page(it.group_id, layer, b)[:] = data[layer * page:(layer + 1) * page]
    w0.store(last)

    (reader,) = tp.world(decode, 1)
    res = pull(reader, prefill.peer_address, keys)
    # Rank 0 for a hit of 3: full 0-2, window 1-2; rank 1 for 2: full 0-1, window 0-1; rank 0 again: window 0.
    assert (res.hit_chunks, res.pulled) == (2, 5 + 4 + 1), res
    reader.retrieve(tp.items(reader, keys[:2], first=9, hit=True), res.lease_id)
    tp.check_loaded(reader, keys[:2], kv, first=9)
    for e in (*writers, reader):
        e.close()


@pytest.mark.parametrize(("k", "j"), [(2, 1), (1, 2)])
def test_gdn_states_are_pulled_across_tp_sizes(pair: Any, k: int, j: int) -> None:
    """A GDN group beside the attention one: each decode rank loads its own conv channels and value heads' SSM
    states, re-sharded from the prefill ranks' entries, as on one node."""
    prefill, decode = pair
    writers = tp.gdn_world(prefill, k)
    c = writers[0].chunk_size
    keys = chunk_keys(prompt_tokens(c * 3, seed=30 + k), c)
    kv, states = tp.model_kv(keys), tp.gdn_states(keys)
    tp.gdn_store(writers, keys, kv, states)
    readers = tp.gdn_world(decode, j)
    for r in readers:
        res = pull(r, prefill.peer_address, keys)
        assert res.hit_chunks == 3, res
        r.retrieve(tp.gdn_items(r, keys, 9, hit=True), res.lease_id)
        tp.gdn_check(r, keys, kv, states, 9)
    assert decode.status()["peer"]["transport"]["reads_failed"] == 0
    for e in (*writers, *readers):
        e.close()


@pytest.mark.parametrize(("pull_args", "kw", "reason"), [
    ((), {"mamba": True}, "Mamba states are not re-sharded across TP sizes: no state split registered"),
    (("--tp-reshard", "off"), {}, "--tp-reshard off (a miss"),
], ids=["mamba", "tp-reshard-off"])
def test_a_world_it_cannot_read_is_a_miss_and_one_log_line(pair_factory: Any, pull_args: tuple[str, ...],
                                                           kw: dict[str, Any], reason: str) -> None:
    prefill, decode = pair_factory(pull_args=pull_args)
    writers = tp.world(prefill, 2, **kw)
    c = writers[0].chunk_size
    keys = chunk_keys(prompt_tokens(c * 2, seed=23), c)
    tp.store(writers, keys, tp.model_kv(keys))
    (reader,) = tp.world(decode, 1, **kw)
    for _ in range(2):
        res = pull(reader, prefill.peer_address, keys)
        assert (res.hit_chunks, res.lease_id, res.pulled) == (0, 0, 0), res
    assert reader.lookup(keys, lease=False)[0] == 0
    d = decode.status()
    assert d["index"]["entries"] == 0 and d["peer"]["transport"]["reads"] == 0
    log = decode.log_path.read_text()
    assert log.count(reason) == 1, log[-3000:]
    for e in (*writers, reader):
        e.close()
