"""Entries across tensor-parallel sizes against a real daemon: one TP size stores, another reads, re-sharded.

Synthetic engine ranks of one model (the same ``model_identity``) whose attention pages hold their ranks'
KV heads (``EngineSpec.heads``; pages [heads, states, cell], the ``HNC`` order). The model's whole KV per
chunk is drawn with NumPy; each rank writes its heads' slices; a reader of another TP size must load exactly
its own heads' slices. GDN states likewise (``EngineSpec.states``): the model's whole conv and SSM states per
chunk, each rank's page cut from them as vLLM lays it. Shapes the daemon cannot re-shard are a miss and one log line
naming why.
"""

from __future__ import annotations

import numpy as np
import pytest

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.errors import LeaseExpired
from hkvd.transport.keys import chunk_keys
from hkvd.transport.reshard import rank_heads
from hkvd.transport.wire.kv import Item

TOKENS, CELL, LAYERS, TOTAL = 16, 32, 2, 4  # tokens (states) per block, bytes per cell, layers, KV heads
MODEL = "tiny-gqa"


def shapes(here: int, mamba: bool = False) -> list[GroupShape]:
    page = here * TOKENS * CELL
    out = [GroupShape("full", LAYERS, page), GroupShape("swa", LAYERS, page, window_tokens=WINDOW)]
    return [*out, GroupShape("mamba", 1, 4096)] if mamba else out


def world(daemon, tp: int, *, total: int = TOTAL, here: int | None = None, mamba: bool = False,
          identity: str = "weights-1", dtype: str = "bfloat16") -> list[SyntheticEngine]:
    here = TOTAL // tp if here is None else here
    return [SyntheticEngine(daemon.socket_path, shapes(here, mamba), world_size=tp, rank=r, model=MODEL,
                            layout_tag="host/HNC", model_identity=identity, dtype=dtype,
                            heads=[(0, here, total, TOKENS), (1, here, total, TOKENS)]) for r in range(tp)]


def model_kv(keys: list[bytes]) -> dict[tuple[int, int, int], np.ndarray]:
    """(group, chunk, block in chunk) -> the model's KV of that block: [layer, head, state, cell] bytes."""
    out = {}
    for c, key in enumerate(keys):
        rng = np.random.default_rng(int.from_bytes(key[:4], "little"))
        for g in (0, 1):
            for i in range(2):
                out[(g, c, i)] = rng.integers(-128, 128, size=(LAYERS, TOTAL, TOKENS, CELL), dtype=np.int8)
    return out


def rank_block(kv: np.ndarray, tp: int, rank: int) -> bytes:
    return b"".join(kv[layer, rank_heads(tp, TOTAL, rank)].tobytes() for layer in range(LAYERS))


WINDOW = 48


def items(eng: SyntheticEngine, keys: list[bytes], first: int = 1, hit: bool = False):  # type: ignore[no-untyped-def]
    """Both groups' items of ``keys``; ``hit``: only those a hit of every chunk loads (the window's chunks)."""
    c, n = eng.chunk_size, len(keys)
    swa = [i for i in range(n) if not hit or (i + 1) * c > n * c - WINDOW]
    return eng.items(0, keys, first_block=first) + eng.items(1, keys, first_block=first, chunks=swa)


def store(engines: list[SyntheticEngine], keys: list[bytes], kv) -> None:  # type: ignore[no-untyped-def]
    tp = len(engines)
    for eng in engines:
        its = items(eng, keys)
        for it in its:
            for i, b in enumerate(it.block_ids):
                data = np.frombuffer(rank_block(kv[(it.group_id, it.chunk_index, i)], tp, eng.spec.rank), np.int8)
                page = eng.groups[it.group_id].views[0].page_bytes
                for layer in range(LAYERS):
                    eng.page(it.group_id, layer, b)[:] = data[layer * page:(layer + 1) * page]
        eng.store(its)


def check_loaded(eng: SyntheticEngine, keys: list[bytes], kv, first: int) -> None:  # type: ignore[no-untyped-def]
    tp = eng.spec.world_size
    for it in items(eng, keys, first, hit=True):
        for i, b in enumerate(it.block_ids):
            assert eng.block_bytes(it.group_id, b) == rank_block(kv[(it.group_id, it.chunk_index, i)], tp,
                                                                 eng.spec.rank), (tp, eng.spec.rank, it.group_id)


def test_tp2_stores_and_tp1_reads_its_heads(daemon):
    writers = world(daemon, 2)
    keys = chunk_keys(prompt_tokens(writers[0].chunk_size * 3, seed=5), writers[0].chunk_size)
    kv = model_kv(keys)
    store(writers, keys, kv)
    for w in writers:
        w.close()  # the writers leave: their world's format stays known
    (reader,) = world(daemon, 1)
    assert reader.fingerprint != writers[0].fingerprint
    hit, lease = reader.lookup(keys)
    assert hit == 3
    reader.retrieve(items(reader, keys, first=9, hit=True), lease)  # other blocks than the writers used
    check_loaded(reader, keys, kv, first=9)
    with pytest.raises(LeaseExpired):  # one use per reader rank: spent
        reader.retrieve(items(reader, keys, first=9, hit=True), lease)
    reader.close()


def test_tp1_stores_and_each_tp2_rank_reads_its_heads_under_one_lease(daemon):
    (writer,) = world(daemon, 1)
    keys = chunk_keys(prompt_tokens(writer.chunk_size * 2, seed=6), writer.chunk_size)
    kv = model_kv(keys)
    store([writer], keys, kv)
    readers = world(daemon, 2)
    hit, lease = readers[0].lookup(keys)  # the scheduler's lookup, for both ranks
    assert hit == 2
    for r in readers:
        r.retrieve(items(r, keys, first=5, hit=True), lease)
        check_loaded(r, keys, kv, first=5)
    # A TP=4 world with replication-free heads (one each) reads the TP=1 and TP=2 entries alike.
    fours = world(daemon, 4)
    hit, lease = fours[3].lookup(keys)
    assert hit == 2
    for r in fours:
        r.retrieve(items(r, keys, first=3, hit=True), lease)
        check_loaded(r, keys, kv, first=3)
    for e in (writer, *readers, *fours):
        e.close()


def test_the_hit_is_what_every_source_rank_holds(daemon):
    writers = world(daemon, 2)
    keys = chunk_keys(prompt_tokens(writers[0].chunk_size * 3, seed=7), writers[0].chunk_size)
    kv = model_kv(keys)
    store(writers, keys, kv)
    (reader,) = world(daemon, 1)
    assert reader.lookup(keys[:2], lease=False)[0] == 2
    other = chunk_keys(prompt_tokens(writers[0].chunk_size * 3, seed=8), writers[0].chunk_size)
    store(writers[:1], other, model_kv(other))  # only rank 0 of the TP=2 world stored this prompt
    assert reader.lookup(other, lease=False)[0] == 0
    for e in (*writers, reader):
        e.close()


@pytest.mark.parametrize(("kw", "reader_kw", "reason"), [
    ({"mamba": True}, {"mamba": True}, "Mamba states are not re-sharded across TP sizes: no state split registered"),
    ({"dtype": "float8_e4m3fn"}, {}, "kind, window or dtype differ"),
    ({"total": 3, "here": 2}, {"total": 3, "here": 3}, "3 KV heads do not split over TP=2"),
])
def test_shapes_it_cannot_reshard_are_a_miss_and_one_log_line(daemon, kw, reader_kw, reason):
    writers = world(daemon, 2, **kw)
    keys = chunk_keys(prompt_tokens(writers[0].chunk_size * 2, seed=9), writers[0].chunk_size)
    kv = model_kv(keys)
    if kw.get("mamba"):  # the attention entries and the states, on both ranks
        for w in writers:
            w.store(items(w, keys) + w.items(2, keys, first_block=1))
    else:
        store(writers, keys, kv)
    (reader,) = world(daemon, 1, **reader_kw)
    assert writers[0].lookup(keys, lease=False)[0] == 2  # the writers' own world hits
    for _ in range(3):
        assert reader.lookup(keys, lease=False)[0] == 0
    log = daemon.log_path.read_text()
    assert log.count(reason) == 1, log[-3000:]
    for e in (*writers, reader):
        e.close()


def test_tp_reshard_off_keeps_each_tp_size_to_its_own_entries(daemon_factory):
    d = daemon_factory("--l1-size-gb", "0.125", "--chunk-size", "32", "--tp-reshard", "off")
    writers = world(d, 2)
    keys = chunk_keys(prompt_tokens(writers[0].chunk_size * 2, seed=12), writers[0].chunk_size)
    store(writers, keys, model_kv(keys))
    (reader,) = world(d, 1)
    assert writers[0].lookup(keys, lease=False)[0] == 2  # the writers' own world hits
    for _ in range(2):
        assert reader.lookup(keys, lease=False)[0] == 0
    log = d.log_path.read_text()
    assert log.count("--tp-reshard off (a miss") == 1, log[-3000:]
    assert "tp_reshards" not in d.status()["counters"]
    for e in (*writers, reader):
        e.close()


def test_another_model_identity_is_never_read(daemon):
    writers = world(daemon, 2, identity="weights-2")
    keys = chunk_keys(prompt_tokens(writers[0].chunk_size * 2, seed=10), writers[0].chunk_size)
    store(writers, keys, model_kv(keys))
    (reader,) = world(daemon, 1, identity="weights-1")
    assert reader.lookup(keys, lease=False)[0] == 0
    for e in (*writers, reader):
        e.close()


def test_usable_prefix_answers_what_each_tp_size_would_hit(daemon_factory):
    import http.client
    import json
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = daemon_factory("--l1-size-gb", "0.125", "--chunk-size", "32", "--metrics-port", str(port))
    writers = world(d, 2)
    c = writers[0].chunk_size
    tokens = prompt_tokens(c * 3 + 1, seed=11)
    keys = chunk_keys(tokens, c)
    store(writers, keys, model_kv(keys))
    readers = {1: world(d, 1)[0], 4: world(d, 4)[0]}  # engines of two more TP sizes: three formats of the model
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def call(method: str, path: str, body: object = None):  # type: ignore[no-untyped-def]
        conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())

    code, listing = call("GET", "/v1/models")
    assert code == 200, listing
    labels = {f["world_size"]: f["format"] for f in listing["models"] if f["model"] == MODEL}
    assert sorted(labels) == [1, 2, 4]
    for tp, eng in readers.items():
        code, out = call("POST", "/v1/usable_prefix", {"model": MODEL, "format": labels[tp], "token_ids": tokens})
        assert code == 200, out
        assert out["usable_tokens"] == 3 * c == eng.lookup(keys, lease=False)[0] * c, (tp, out)
    for e in (*writers, *readers.values()):
        e.close()


# A GDN group beside the full-attention one: 4 key heads of 2, 8 value heads of 2, conv kernel 4 (state_len 3); conv
# state (state_len, conv_dim) bfloat16 (vLLM's "SD"), SSM state (value heads, 2, 2) float32. One GDN layer.
NK, NV, DK, DV, STATE_LEN = 4, 8, 2, 2, 3
KD, VD = NK * DK, NV * DV


def gdn_world(daemon, tp: int) -> list[SyntheticEngine]:  # type: ignore[no-untyped-def]
    here = TOTAL // tp
    conv = (2 * KD + VD) // tp
    dtype = f"state:bfloat16[{STATE_LEN}, {conv}];float32[{NV // tp}, {DV}, {DK}]"
    shapes = [GroupShape("full", LAYERS, here * TOKENS * CELL),
              GroupShape("mamba", 1, 2 * STATE_LEN * conv + 4 * NV // tp * DV * DK, dtype=dtype)]
    return [SyntheticEngine(daemon.socket_path, shapes, world_size=tp, rank=r, model=MODEL, layout_tag="host/HNC",
                            model_identity="gdn-1", heads=[(0, here, TOTAL, TOKENS)],
                            states=[(1, "gdn_attn", ((1, (KD, KD, VD)), (0, (NV,))))]) for r in range(tp)]


def gdn_states(keys: list[bytes]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """chunk -> the model's states at its end: conv [state_len, q k v channels, 2 bytes], SSM [NV, DV, DK, 4 bytes]."""
    out = {}
    for c, key in enumerate(keys):
        rng = np.random.default_rng(int.from_bytes(key[4:8], "little"))
        out[c] = (rng.integers(0, 256, size=(STATE_LEN, 2 * KD + VD, 2), dtype=np.uint8),
                  rng.integers(0, 256, size=(NV, DV, DK, 4), dtype=np.uint8))
    return out


def gdn_page(states: tuple[np.ndarray, np.ndarray], tp: int, rank: int) -> bytes:
    """A rank's GDN page as vLLM lays it: its q, k and v channels of the conv state, then its value heads' SSM."""
    conv, ssm = states
    q, v = KD // tp, VD // tp
    chans = [*range(rank * q, (rank + 1) * q), *range(KD + rank * q, KD + (rank + 1) * q),
             *range(2 * KD + rank * v, 2 * KD + (rank + 1) * v)]
    return conv[:, chans].tobytes() + ssm[rank * (NV // tp):(rank + 1) * (NV // tp)].tobytes()


def gdn_items(eng: SyntheticEngine, keys: list[bytes], first: int, hit: bool = False) -> list[Item]:
    """Full items of ``keys`` and the states at each chunk's end (``hit``: at the last chunk's only)."""
    states = eng.items(1, keys, first_block=first + 2 * len(keys))
    return eng.items(0, keys, first_block=first) + (states[-1:] if hit else states)


def gdn_store(engines: list[SyntheticEngine], keys: list[bytes], kv, states) -> None:  # type: ignore[no-untyped-def]
    tp = len(engines)
    for eng in engines:
        its = gdn_items(eng, keys, 1)
        for it in its:
            for i, b in enumerate(it.block_ids):
                if it.group_id == 1:
                    eng.page(1, 0, b)[:] = np.frombuffer(gdn_page(states[it.chunk_index], tp, eng.spec.rank), np.int8)
                    continue
                data = np.frombuffer(rank_block(kv[(0, it.chunk_index, i)], tp, eng.spec.rank), np.int8)
                page = eng.groups[0].views[0].page_bytes
                for layer in range(LAYERS):
                    eng.page(0, layer, b)[:] = data[layer * page:(layer + 1) * page]
        eng.store(its)


def gdn_check(eng: SyntheticEngine, keys: list[bytes], kv, states, first: int) -> None:  # type: ignore[no-untyped-def]
    tp, rank = eng.spec.world_size, eng.spec.rank
    for it in gdn_items(eng, keys, first, hit=True):
        for i, b in enumerate(it.block_ids):
            want = (gdn_page(states[it.chunk_index], tp, rank) if it.group_id == 1
                    else rank_block(kv[(0, it.chunk_index, i)], tp, rank))
            assert eng.block_bytes(it.group_id, b) == want, (tp, rank, it.group_id, it.chunk_index)


@pytest.mark.parametrize(("k", "j"), [(2, 1), (1, 2)])
def test_gdn_states_are_read_across_tp_sizes(daemon, k: int, j: int) -> None:
    writers = gdn_world(daemon, k)
    keys = chunk_keys(prompt_tokens(writers[0].chunk_size * 3, seed=40 + k), writers[0].chunk_size)
    kv, states = model_kv(keys), gdn_states(keys)
    gdn_store(writers, keys, kv, states)
    readers = gdn_world(daemon, j)
    hit, lease = readers[0].lookup(keys)
    assert hit == 3
    for r in readers:
        r.retrieve(gdn_items(r, keys, 9, hit=True), lease)
        gdn_check(r, keys, kv, states, 9)
    assert daemon.status()["counters"]["tp_reshards"]
    assert "are not served to a TP=" not in daemon.log_path.read_text()
    for e in (*writers, *readers):
        e.close()
