"""Usable-prefix lookups on a real daemon with a disk tier: synthetic hybrid engines (full attention, a
sliding window, Mamba states) store prompts with holes and evictions, and the endpoint's answer equals the
hit a fresh engine's lookup then gets; salted prefixes are invisible without their salt; nothing it does
leases, promotes or counts as an engine lookup."""

from __future__ import annotations

import base64
import http.client
import json
import random
import socket
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.extras import chunk_extras
from hkvd.transport.keys import chunk_keys
from hkvd.transport.wire.kv import Item

C = 16  # tokens per block and per chunk
WINDOW = 40  # the sliding window, in tokens: a hit of n chunks needs swa chunks from (16n - 40) // 16
PAGE = 128 << 10  # entries of 2 layers x 128 KiB: a 64 MiB pool holds about 240 of them
SHAPES = [GroupShape("full", 2, PAGE), GroupShape("swa", 2, PAGE, window_tokens=WINDOW), GroupShape("mamba", 2, PAGE)]
FULL, SWA, MAMBA = 0, 1, 2
MAX_CHUNKS = 12
KW: dict[str, Any] = {"num_blocks": MAX_CHUNKS + 2, "tokens_per_block": C, "chunk_size": C,
                      "model": "/models/tiny-hybrid"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Router:
    """A keep-alive HTTP client of the metrics port."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def call(self, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        self.conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        text = resp.read()
        return resp.status, json.loads(text) if resp.getheader("Content-Type") == "application/json" else text

    def usable(self, tokens: list[int], **extra: Any) -> dict[str, Any]:
        code, out = self.call("POST", "/v1/usable_prefix", {"model": KW["model"], "token_ids": tokens, **extra})
        assert code == 200, out
        return out


def keys_of(tokens: list[int], salt: str | None = None) -> list[bytes]:
    n = len(tokens) // C
    return chunk_keys(tokens, C, extras=chunk_extras(n, C, cache_salt=salt))


class Store:
    """Stores chunks the way the shim does: attention items with their parents, Mamba states offered in a
    step event and confirmed in the next."""

    def __init__(self, eng: SyntheticEngine) -> None:
        self.eng = eng
        self.seq = 0
        self.step = 0

    def put(self, keys: list[bytes], full: set[int], swa: set[int], mamba: set[int]) -> None:
        eng = self.eng
        items = [Item(g, i, keys[i], [1 + i], keys[i - 1] if i else b"")
                 for g, chunks in ((FULL, full), (SWA, swa)) for i in sorted(chunks)]
        if items:
            eng.store(items)
        if mamba:
            offers = [Item(MAMBA, i, keys[i], [1 + i], keys[i - 1] if i else b"") for i in sorted(mamba)]
            req = eng.client.submit_step_event(self.seq, self.step, offers)
            eng.run(req)
            confirm = eng.client.submit_step_event(self.seq + 1, self.step + 1, [], [req])
            eng.run(confirm)
            self.seq += 2
            self.step += 2

    def drain_disk(self) -> None:
        import time

        deadline = time.monotonic() + 30
        while self.eng.client.status()["l2"]["queued"]:
            assert time.monotonic() < deadline, "the disk tier's queue did not drain"
            time.sleep(0.02)


def fresh_hit(socket_path: str, tokens: list[int], salt: str | None = None) -> int:
    """The hit a fresh engine gets for ``tokens``: the shim's lookup (at most (len - 1) // C chunks)."""
    eng = SyntheticEngine(socket_path, SHAPES, **KW)
    try:
        keys = keys_of(tokens, salt)[:(len(tokens) - 1) // C]
        if not keys:
            return 0
        hit, lease = eng.lookup(keys)
        if lease:
            eng.client.release(lease)
        return hit * C
    finally:
        eng.close()


@pytest.fixture
def node(daemon_factory, tmp_path: Path):  # type: ignore[no-untyped-def]
    port = free_port()
    d = daemon_factory("--l1-size-gb", "0.0625", "--chunk-size", str(C), "--metrics-port", str(port),
                       "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "1")
    eng = SyntheticEngine(d.socket_path, SHAPES, **KW)
    yield d, Router(port), eng
    eng.close()


def test_hybrid_rule_per_tier_and_the_cap(node) -> None:  # type: ignore[no-untyped-def]
    d, router, eng = node
    store = Store(eng)
    tokens = prompt_tokens(8 * C + 5, seed=1)
    keys = keys_of(tokens)
    # Every attention chunk, Mamba states after chunks 3 and 7 only (boundaries 64 and 128).
    store.put(keys, full=set(range(8)), swa=set(range(8)), mamba={3, 7})
    store.drain_disk()
    out = router.usable(tokens)
    assert out["usable_tokens"] == out["prefix_tokens"] == 128
    assert out["tiers"] == {"pool": 128, "disk": 128, "cluster": None}
    assert out["chunk_size"] == C and out["prompt_tokens"] == 8 * C + 5
    # Exactly 8 chunks: vLLM computes the last token, so a hit may take 7 chunks at most; the state after
    # chunk 6 is missing, so the hit falls back to the state at 64 tokens.
    exact = router.usable(tokens[:8 * C])
    assert exact["usable_tokens"] == 64 and exact["prefix_tokens"] == 128
    assert fresh_hit(d.socket_path, tokens[:8 * C]) == 64
    # A hole in the window: swa chunk 6 gone, so 128 needs it ([88, 128) is chunks 5..7) and falls to 64.
    tokens2 = prompt_tokens(8 * C + 1, seed=2)
    keys2 = keys_of(tokens2)
    store.put(keys2, full=set(range(8)), swa={0, 1, 2, 3, 4, 5, 7}, mamba={3, 7})
    assert router.usable(tokens2)["usable_tokens"] == 64 == fresh_hit(d.socket_path, tokens2)
    # A missing full-attention chunk caps everything below it.
    tokens3 = prompt_tokens(8 * C + 1, seed=3)
    store.put(keys_of(tokens3), full={0, 1, 3, 4, 5, 6, 7}, swa=set(range(8)), mamba={0, 3, 7})
    assert router.usable(tokens3)["usable_tokens"] == 16 == fresh_hit(d.socket_path, tokens3)
    # The listing names the model and format, never a fingerprint.
    code, listing = router.call("GET", "/v1/models")
    assert code == 200
    (fmt,) = listing["models"]
    assert fmt["model"] == KW["model"] and fmt["format"] == out["format"] and fmt["chunk_size"] == C
    assert [g["kind"] for g in fmt["groups"]] == ["full", "swa", "mamba"]
    assert fmt["groups"][1]["window_tokens"] == WINDOW
    assert eng.fingerprint.hex()[:8] not in json.dumps(listing) + json.dumps(out)
    # The last path component of the model names it too, and base64 token ids give the same answer.
    b64 = base64.b64encode(np.asarray(tokens, dtype="<u4").tobytes()).decode()
    code, alt = router.call("POST", "/v1/usable_prefix", {"model": "tiny-hybrid", "token_ids_b64": b64})
    assert code == 200 and alt == out
    # A msgpack body with the token ids as a bin of little-endian uint32: the same answer.
    raw = msgpack.packb({"model": KW["model"], "token_ids": np.asarray(tokens, dtype="<u4").tobytes()})
    router.conn.request("POST", "/v1/usable_prefix", body=raw, headers={"Content-Type": "application/msgpack"})
    resp = router.conn.getresponse()
    assert resp.status == 200 and json.loads(resp.read()) == out


def test_salted_prefix_is_invisible_without_its_salt(node) -> None:  # type: ignore[no-untyped-def]
    d, router, eng = node
    store = Store(eng)
    tokens = prompt_tokens(6 * C + 3, seed=5)
    store.put(keys_of(tokens, "tenant-a"), full=set(range(6)), swa=set(range(6)), mamba={5})
    assert router.usable(tokens, cache_salt="tenant-a")["usable_tokens"] == 96
    assert fresh_hit(d.socket_path, tokens, "tenant-a") == 96
    for salt in (None, "", "tenant-b", "tenant-a "):
        extra = {"cache_salt": salt} if salt is not None else {}
        out = router.usable(tokens, **extra)
        assert out["usable_tokens"] == out["prefix_tokens"] == 0, salt
        assert out["tiers"]["pool"] == out["tiers"]["disk"] == 0
        assert fresh_hit(d.socket_path, tokens, salt or None) == 0


def test_read_only_no_lease_no_promotion_no_lookup_counted(node) -> None:  # type: ignore[no-untyped-def]
    d, router, eng = node
    store = Store(eng)
    first = prompt_tokens(10 * C + 1, seed=7)
    store.put(keys_of(first), full=set(range(10)), swa=set(range(10)), mamba=set(range(10)))
    store.drain_disk()
    # Flood the pool (about 240 entries) so that the first prompt's entries are evicted; they stay on disk.
    for seed in range(100, 112):
        other = prompt_tokens(10 * C + 1, seed=seed)
        store.put(keys_of(other), full=set(range(10)), swa=set(range(10)), mamba=set(range(10)))
        store.drain_disk()
    before = eng.client.status()
    out = router.usable(first)
    assert out["tiers"]["pool"] < 160 and out["tiers"]["disk"] == 160 and out["usable_tokens"] == 160
    for _ in range(3):
        assert router.usable(first) == out  # no read into the pool: the pool's answer does not grow
    after = eng.client.status()
    assert after["index"]["leases"] == 0
    assert after["counters"].get("lookups", 0) == before["counters"].get("lookups", 0)
    assert after["counters"].get("l2_hits", 0) == before["counters"].get("l2_hits", 0)
    assert after["index"]["entries"] == before["index"]["entries"]
    # An engine's lookup does read them in: then the pool serves the prefix.
    assert fresh_hit(d.socket_path, first) == 160
    assert router.usable(first)["tiers"]["pool"] == 160


def test_answers_equal_fresh_engine_hits_for_random_prompts(node) -> None:  # type: ignore[no-untyped-def]
    """Random prompts over shared prefixes, stored with random holes (evicted or never offered chunks)."""
    d, router, eng = node
    store = Store(eng)
    rng = random.Random(11)
    bases = [prompt_tokens(MAX_CHUNKS * C, seed=200 + i) for i in range(3)]
    salts = [None, None, "t1", "t2"]

    def prompt() -> tuple[list[int], str | None]:
        base = rng.choice(bases)
        shared = rng.randrange(0, len(base) + 1)
        tail = [rng.randrange(5, 50_000) for _ in range(rng.randrange(0, 3 * C))]
        tokens = (base[:shared] + tail)[:MAX_CHUNKS * C] or [7]
        return tokens, rng.choice(salts)

    for _ in range(12):
        tokens, salt = prompt()
        n = len(tokens) // C
        keep = lambda p, n=n: {i for i in range(n) if rng.random() < p}  # noqa: E731
        store.put(keys_of(tokens, salt), full=set(range(n)) - keep(0.1), swa=set(range(n)) - keep(0.2),
                  mamba=keep(0.5))
    store.drain_disk()
    agree = 0
    seen = set()
    for _ in range(50):
        tokens, salt = prompt()
        extra = {"cache_salt": salt} if salt else {}
        answer = router.usable(tokens, **extra)
        hit = fresh_hit(d.socket_path, tokens, salt)
        assert answer["usable_tokens"] == hit, (len(tokens), salt, answer, hit)
        agree += 1
        seen.add(hit)
    assert agree == 50 and len(seen) > 2  # the prompts hit at several lengths, not all at 0


def test_bad_requests_are_400_or_404_naming_the_fix(node) -> None:  # type: ignore[no-untyped-def]
    _d, router, _eng = node
    model = KW["model"]
    cases = [
        (b"{not json", 400, "not JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"token_ids": [1]}).encode(), 400, "\"model\" is missing"),
        (json.dumps({"model": model}).encode(), 400, "token_ids"),
        (json.dumps({"model": model, "token_ids": [1, -2]}).encode(), 400, "index 1"),
        (json.dumps({"model": model, "token_ids": [1, 2.5]}).encode(), 400, "index 1"),
        (json.dumps({"model": model, "token_ids": "1 2"}).encode(), 400, "list of integers"),
        (json.dumps({"model": model, "token_ids": []}).encode(), 400, "no tokens"),
        (json.dumps({"model": model, "token_ids_b64": "!!"}).encode(), 400, "base64"),
        (json.dumps({"model": model, "token_ids": [1], "salt": "x"}).encode(), 400, "unknown fields"),
        (json.dumps({"model": model, "token_ids": [1], "lora": {"name": "a"}}).encode(), 400, "\"path\""),
        (json.dumps({"model": model, "token_ids": [1], "mm": [{"identifier": "x", "offset": -1,
                                                                "length": 2}]}).encode(), 400, "mm"),
        (json.dumps({"model": model, "token_ids": [1], "tiers": ["gpu"]}).encode(), 400, "tiers"),
        (json.dumps({"model": "other", "token_ids": [1]}).encode(), 404, "GET /v1/models"),
        (json.dumps({"model": model, "format": "c16-00000000", "token_ids": [1]}).encode(), 404, "formats"),
        (json.dumps({"model": model, "token_ids": [1] * 131073}).encode(), 400, "at most 131072"),
    ]
    for raw, status, words in cases:
        code, out = router.call("POST", "/v1/usable_prefix", raw=raw)
        assert code == status and words in out["error"], (raw[:60], code, out)
    # The connection survives them all, and a good request still works on it.
    assert router.usable([1, 2, 3])["usable_tokens"] == 0
    assert router.call("GET", "/v1/usable_prefix")[0] == 405
