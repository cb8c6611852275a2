"""Cold restart with the disk tier (--l2-path), against real daemon processes.

An engine stores prompts (attention-only and a hybrid layout with three Mamba groups whose boundary
states travel by step events), the daemon gets SIGTERM, a new daemon starts on the same directory,
and a NEW engine process looks the prompts up and retrieves them: the hits and every byte must match.
Damaged files must be skipped, counted and never served.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from hkvd.daemon.tiers.disk_format import HEADER_BYTES, relative_path
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, fetch_in_child, prompt_tokens
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire.kv import Item

ATTN = [GroupShape("full", 2, 4096)]
ATTN_KW = {"num_blocks": 256, "tokens_per_block": 16, "chunk_size": 32}
BLOCK = 16
HYBRID = [GroupShape("full", 2, 8192)] + [GroupShape("mamba", 2, 5000, 8192)] * 3
HYBRID_KW = {"num_blocks": 128, "tokens_per_block": BLOCK, "chunk_size": BLOCK, "aliased": True}
MAMBA = (1, 2, 3)
L2_ARGS = ("--l1-size-gb", "0.125", "--chunk-size", "32", "--l2-size-gb", "0.25")


def attn_store(eng: SyntheticEngine, keys: list[bytes], seed: int) -> dict[int, bytes]:
    """Chunk i of the prompt on blocks 1+2i, 2+2i; returns the bytes of each chunk."""
    items = eng.items(0, keys, first_block=1)
    blocks = [b for it in items for b in it.block_ids]
    eng.fill_random(0, blocks, seed)
    assert eng.store(items).result.stored == len(items)
    return {i: b"".join(eng.block_bytes(0, b) for b in it.block_ids) for i, it in enumerate(items)}


def hybrid_store(eng: SyntheticEngine, keys: list[bytes], seed: int, steps: list[int]) -> dict[tuple[int, int], bytes]:
    """One chunk per step: attention chunk i on block 1+i (stored), Mamba state of group g after chunk i on
    block 40+10g+i (offered by the step event, confirmed by the next one, as the shim does). ``steps`` holds
    the engine's next step number: step events of one engine are numbered across prompts."""
    c = eng.client
    written: dict[tuple[int, int], bytes] = {}
    unconfirmed: list[int] = []
    for i, key in enumerate(keys):
        eng.fill_random(0, [1 + i], seed=seed + i)
        written[(0, i)] = eng.block_bytes(0, 1 + i)
        offers = []
        for g in MAMBA:
            blk = 40 + 10 * g + i
            eng.fill_random(g, [blk], seed=seed * 7 + 1000 * g + i)
            written[(g, i)] = eng.block_bytes(g, blk)
            offers.append(Item(g, i, key, [blk], keys[i - 1] if i else b""))
        eng.store([Item(0, i, key, [1 + i], keys[i - 1] if i else b"")])
        done = c.wait(unconfirmed, 10.0) if unconfirmed else {}
        unconfirmed = [c.submit_step_event(steps[0], steps[0], offers, [r for r, comp in done.items() if comp.ok])]
        steps[0] += 1
    done = c.wait(unconfirmed, 10.0)
    eng.run(c.submit_step_event(steps[0], steps[0], [], [r for r, comp in done.items() if comp.ok]))
    steps[0] += 1
    return written


def fetch(socket_path: str, shapes: list[GroupShape], kw: dict, keys: list[bytes], items: list[Item]) -> dict:
    """A NEW engine process of the same layout looks up and retrieves into its own zeroed memory."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=fetch_in_child, args=(socket_path, shapes, kw, keys, items, q))
    p.start()
    try:
        res = q.get(timeout=60)
    finally:
        p.join(30)
    assert "error" not in res, res.get("error")
    return res


def attn_items(keys: list[bytes]) -> list[Item]:  # land on blocks other than the ones stored from
    return [Item(0, i, k, [100 + 2 * i, 101 + 2 * i]) for i, k in enumerate(keys)]


def metrics(port: int, web) -> dict:
    out = {}
    for fam in text_string_to_metric_families(web.get(port, "/metrics")[1]):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_cold_restart_serves_what_was_stored_byte_exact(daemon_factory, tmp_path, web):
    l2 = str(tmp_path / "l2")
    d1 = daemon_factory(*L2_ARGS, "--l2-path", l2, name="first")
    attn_prompts = {seed: chunk_keys(prompt_tokens(32 * n, seed=seed), 32) for seed, n in ((1, 8), (2, 5), (3, 12))}
    hybrid_prompts = {seed: chunk_keys(prompt_tokens(BLOCK * n, seed=seed), BLOCK) for seed, n in ((4, 6), (5, 9))}
    eng = SyntheticEngine(d1.socket_path, ATTN, **ATTN_KW)
    attn_bytes = {seed: attn_store(eng, keys, seed) for seed, keys in attn_prompts.items()}
    eng.close()
    heng = SyntheticEngine(d1.socket_path, HYBRID, **HYBRID_KW)
    steps = [0]
    hybrid_bytes = {seed: hybrid_store(heng, keys, seed, steps) for seed, keys in hybrid_prompts.items()}
    heng.close()
    stored_tokens = 32 * sum(map(len, attn_prompts.values())) + BLOCK * sum(map(len, hybrid_prompts.values()))
    assert d1.status()["index"]["pending"] == 0
    assert d1.stop() == 0
    assert "0 not flushed" in d1.log()
    # 25 attention chunks + 15 hybrid chunks x (1 attention + 3 Mamba states) on disk
    assert sum(n.endswith(".hkv") for _, _, f in os.walk(l2) for n in f) == 25 + 15 * 4

    port = web.free_port()
    d2 = daemon_factory(*L2_ARGS, "--l2-path", l2, "--metrics-port", str(port), name="second")
    assert "holds 85 entries" in d2.log()
    hit_tokens = 0
    for seed, keys in attn_prompts.items():
        res = fetch(d2.socket_path, ATTN, ATTN_KW, keys, attn_items(keys))
        assert res["hit_chunks"] == len(keys)
        for i in range(len(keys)):
            assert res["blocks"][(0, 100 + 2 * i)] + res["blocks"][(0, 101 + 2 * i)] == attn_bytes[seed][i]
        hit_tokens += 32 * res["hit_chunks"]
    for seed, keys in hybrid_prompts.items():
        n = len(keys)
        items = [Item(0, i, keys[i], [60 + i]) for i in range(n)]
        items += [Item(g, n - 1, keys[n - 1], [90 + g]) for g in MAMBA]  # the state at exactly n chunks
        res = fetch(d2.socket_path, HYBRID, HYBRID_KW, keys, items)
        assert res["hit_chunks"] == n
        for i in range(n):
            assert res["blocks"][(0, 60 + i)] == hybrid_bytes[seed][(0, i)]
        for g in MAMBA:
            assert res["blocks"][(g, 90 + g)] == hybrid_bytes[seed][(g, n - 1)]
        hit_tokens += BLOCK * res["hit_chunks"]
    ratio = hit_tokens / stored_tokens
    print(f"\ncold restart: {hit_tokens} of {stored_tokens} stored prefix tokens hit ({ratio:.1%})")
    assert ratio >= 0.95

    st = d2.status()
    # Loaded from disk: every attention chunk, and only the last Mamba state of each hybrid prompt.
    assert st["by_kind"]["l2_hits"] == {"full": 25 + 15, "mamba": 2 * 3}
    assert st["l2"]["reads"] == 46 and st["l2"]["corrupt"] == {} and st["l2"]["writes"] == 0
    m = metrics(port, web)
    assert m[("hkvd_l2_hits_total", (("kind", "mamba"),))] == 6
    assert m[("hkvd_l2_entries", ())] == 85
    assert m[("hkvd_l2_reads_total", ())] == 46
    assert m[("hkvd_l2_capacity_bytes", ())] == 0.25 * (1 << 30)
    assert m[("hkvd_l2_read_gbps", ())] > 0
    out = subprocess.run([sys.executable, "-m", "hkvd.daemon", "status", "--socket", d2.socket_path],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    disk = next(line for line in out.splitlines() if line.startswith("disk "))
    assert "in 85 entries, 46 read back" in disk and l2 in disk
    assert d2.stop() == 0


def test_damaged_files_are_skipped_counted_and_never_served(daemon_factory, tmp_path):
    l2 = tmp_path / "l2"
    d1 = daemon_factory(*L2_ARGS, "--l2-path", str(l2), name="first")
    eng = SyntheticEngine(d1.socket_path, ATTN, **ATTN_KW)
    fp = eng.fingerprint
    a = chunk_keys(prompt_tokens(32 * 8, seed=11), 32)
    b = chunk_keys(prompt_tokens(32 * 8, seed=12), 32)
    a_bytes, b_bytes = attn_store(eng, a, 11), attn_store(eng, b, 12)
    eng.close()
    assert d1.stop() == 0

    flipped = l2 / relative_path((fp, 0, a[3]))
    raw = bytearray(flipped.read_bytes())
    raw[HEADER_BYTES + 777] ^= 0x01  # one bit of payload: only the payload CRC can tell
    flipped.write_bytes(bytes(raw))
    truncated = l2 / relative_path((fp, 0, b[5]))
    os.truncate(truncated, HEADER_BYTES + 1000)  # a write cut short under its final name

    d2 = daemon_factory(*L2_ARGS, "--l2-path", str(l2), name="second")
    assert d2.status()["l2"]["corrupt"] == {"truncated": 1}  # found by the scan
    assert not truncated.exists()
    # (The child retrieves the items it is given: the first 3 here. A longer hit fails the assert, a shorter
    # one the retrieve.)
    res = fetch(d2.socket_path, ATTN, ATTN_KW, a, attn_items(a)[:3])
    assert res["hit_chunks"] == 3  # chunk 3 failed its checksum: the hit stops before it
    for i in range(3):
        assert res["blocks"][(0, 100 + 2 * i)] + res["blocks"][(0, 101 + 2 * i)] == a_bytes[i]
    res = fetch(d2.socket_path, ATTN, ATTN_KW, b, attn_items(b)[:5])
    assert res["hit_chunks"] == 5
    for i in range(5):
        assert res["blocks"][(0, 100 + 2 * i)] + res["blocks"][(0, 101 + 2 * i)] == b_bytes[i]
    st = d2.status()
    assert st["l2"]["corrupt"] == {"truncated": 1, "checksum": 1}
    assert st["counters"]["l2_read_failures"] == 1
    assert not flipped.exists()
    log = d2.log()
    assert f"skipping {truncated}" in log and f"{flipped} is corrupt" in log
    # Asked again, the damaged chunk is simply absent (recompute), never served.
    assert fetch(d2.socket_path, ATTN, ATTN_KW, a, attn_items(a)[:3])["hit_chunks"] == 3
    assert d2.stop() == 0


def test_l2_flags_are_checked_at_start(tmp_path):
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hkvd.daemon", "serve", "--socket", str(tmp_path / "s.sock"),
                               *args], capture_output=True, text=True, timeout=60, check=False)

    out = serve("--l2-path", str(tmp_path / "l2"))
    assert out.returncode == 2 and "also set --l2-size-gb" in out.stderr
    out = serve("--l2-size-gb", "1")
    assert out.returncode == 2 and "--l2-size-gb needs --l2-path" in out.stderr
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = serve("--l2-path", str(Path(blocker) / "l2"), "--l2-size-gb", "1", "--l1-size-gb", "0.0625",
                "--hugepages", "off")
    assert out.returncode == 1 and "writable directory" in out.stderr
