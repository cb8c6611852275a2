"""Usable-prefix lookups in-process: the request's validation, the format table, the per-tier answer under
the hybrid rule and the cap, the key function on packed tokens, and the metrics port's HTTP/1.1 server
(keep-alive, pipelining in order, bounds)."""

from __future__ import annotations

import asyncio
import json
import random
import weakref
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest

from hkvd.daemon.cache import MIN_SUPERBLOCK_BYTES, Cache, GroupRule, HugePagePool, make_policy
from hkvd.daemon.http import MAX_BODY_BYTES, HTTPEndpoint, Request, Response
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.routing.usable_prefix import (
    MAX_FORMATS,
    BadRequest,
    FormatBook,
    LazyKeys,
    UsablePrefix,
    format_label,
    parse_query,
)
from hkvd.transport.extras import MMItem, chunk_extras, encode_extra, range_extra_keys
from hkvd.transport.keys import ROOT_KEY, chunk_keys, chunk_keys_le32

C = 16


def engine(model: str = "/m/tiny", fps: tuple[bytes, ...] = (b"\1" * 16,), kinds: tuple[str, ...] = ("full",),
           window: int = 32) -> Any:
    rules = [GroupRule(g, k, window if k == "swa" else 0) for g, k in enumerate(kinds)]  # type: ignore[arg-type]
    return SimpleNamespace(spec=SimpleNamespace(model=model), chunk_size=C, fingerprint=fps[0],
                           rank_fingerprints=fps, world_fingerprints=fps, rules=rules, kinds=dict(enumerate(kinds)),
                           entry_bytes=dict.fromkeys(range(len(kinds)), 4096))


class FakeDisk:
    def __init__(self) -> None:
        self.held: dict[tuple[bytes, int, bytes], Any] = {}

    def get(self, key: Any) -> Any:
        return self.held.get(key)

    def usable(self) -> bool:
        return bool(self.held)

    def put(self, key: Any, kind: str, nbytes: int = 4096) -> None:
        self.held[key] = SimpleNamespace(nbytes=nbytes, kind=kind)


class ReadySet(Cache):
    """The real cache's lookup planning over a set of READY keys (the set may change between questions)."""

    def __init__(self, ready: set[Any]) -> None:
        pool = HugePagePool(2 * MIN_SUPERBLOCK_BYTES, "off", superblock_bytes=MIN_SUPERBLOCK_BYTES)
        weakref.finalize(self, pool.close)
        super().__init__(pool, make_policy("lru"))
        self.ready = ready

    def is_ready(self, key: Any) -> bool:
        return key in self.ready


def service(ready: set[Any], disk: FakeDisk | None = None, cluster: Any = None) -> Any:
    return SimpleNamespace(index=ReadySet(ready), disk=disk, cluster=cluster)


def ask(up: UsablePrefix, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    got = up.post(Request("POST", "/v1/usable_prefix", "", {"content-type": "application/json"},
                          json.dumps(body).encode()))
    assert isinstance(got, Response)
    out = json.loads(got.body)
    if got.status == 200:  # the answer is written by hand: the bytes json.dumps would give
        assert got.body == json.dumps(out, separators=(",", ":")).encode()
    return got.status, out


# ---- keys and extras ----------------------------------------------------------------------------------


def test_packed_keys_equal_the_shims_keys():
    rng = random.Random(3)
    for _ in range(50):
        toks = [rng.randrange(0, 1 << 32) for _ in range(rng.randrange(0, 10 * C))]
        n = len(toks) // C
        extras = [rng.choice([b"", b"x" * rng.randrange(1, 40)]) for _ in range(n)] if rng.random() < 0.5 else None
        parent = bytes(rng.randrange(256) for _ in range(16))
        packed = b"".join(t.to_bytes(4, "little") for t in toks)
        want = chunk_keys(toks, C, parent=parent, extras=extras)
        assert chunk_keys_le32(packed, C, parent=parent, extras=extras) == want
        lazy = LazyKeys(packed, C, extras) if parent == ROOT_KEY else None
        if lazy is None:
            lazy, want = LazyKeys(packed, C, extras), chunk_keys(toks, C, extras=extras)
        assert len(lazy) == n
        stop = rng.randrange(0, n + 1)  # hashed only as far as asked, in order
        refused = want[stop:stop + 1]
        assert lazy.while_(lambda k, refused=refused: k not in refused) == want[:stop]
        assert len(lazy._keys) <= min(n, max(stop + LazyKeys.STEP, 2 * stop))
        assert lazy.all() == want


def test_range_extra_keys_follow_vllms_rule():
    # image "a" covers tokens [20, 40): chunks 1 and 2 (offsets 4 and -12); "b" [64, 65): chunk 4 only.
    mm = [MMItem("a", 20, 20), MMItem("b", 64, 1)]
    got = []
    idx = 0
    for i in range(6):
        extra, idx = range_extra_keys(i * C, (i + 1) * C, lora=("ad", "/p"), mm=mm, cache_salt="s", mm_idx=idx)
        got.append(extra)
    assert got[0] == (("lora", "ad", "/p"), ("cache_salt", "s"))
    assert got[1] == (("lora", "ad", "/p"), ("mm", "a", 4))
    assert got[2] == (("lora", "ad", "/p"), ("mm", "a", -12))
    assert got[3] == (("lora", "ad", "/p"),)
    assert got[4] == (("lora", "ad", "/p"), ("mm", "b", 0))
    assert range_extra_keys(0, C, lora=None, mm=[], cache_salt="")[0] is None
    ex = chunk_extras(3, C, lora=("ad", "/p"), lora_digest="d1", mm=mm, cache_salt="s")
    assert ex is not None and ex[0] == encode_extra(got[0], "d1")
    assert chunk_extras(3, C) is None  # no extras: the token-only keys, as the shim's


# ---- the request ---------------------------------------------------------------------------------------


def test_malformed_bodies_are_bad_requests_never_other_errors():
    book = FormatBook()
    book.add(engine())
    rng = random.Random(5)
    atoms: list[Any] = [None, True, 0, -1, 1.5, 2**40, "", "x", [], {}, [1, 2], ["1"], {"a": 1}, "/m/tiny", "tiny"]
    fields = ["model", "format", "token_ids", "token_ids_b64", "cache_salt", "lora", "mm", "tiers", "extra"]

    def value(depth: int = 0) -> Any:
        r = rng.random()
        if depth < 2 and r < 0.2:
            return [value(depth + 1) for _ in range(rng.randrange(4))]
        if depth < 2 and r < 0.35:
            keys = ["name", "path", "digest", "identifier", "offset", "length", "x"]
            return {rng.choice(keys): value(depth + 1) for _ in range(rng.randrange(4))}
        return rng.choice(atoms)

    for _ in range(3000):
        body = {rng.choice(fields): value() for _ in range(rng.randrange(5))}
        if rng.random() < 0.5:
            body["model"] = "/m/tiny"
        try:
            parse_query(json.dumps(body).encode(), book)
        except BadRequest as e:
            assert e.status in (400, 404) and str(e)
    for raw in (b"", b"\xff\xfe", b"nul", b"1e999999", b"{" * 5000 + b"}" * 5000):
        with pytest.raises(BadRequest):
            parse_query(raw, book)
    packer = msgpack.Packer(use_bin_type=True)
    for i in range(2000):  # msgpack bodies: the same rule
        body = {rng.choice(fields): value() for _ in range(rng.randrange(5))}
        if rng.random() < 0.3:
            body["token_ids"] = bytes(rng.randrange(256) for _ in range(rng.randrange(9)))
        raw = packer.pack(body if i % 7 else [body])
        if i % 11 == 0:
            raw = raw[:rng.randrange(len(raw) + 1)] + bytes([rng.randrange(256)])
        try:
            parse_query(raw, book, "application/msgpack")
        except BadRequest as e:
            assert e.status in (400, 404) and str(e)
    # empty, a reserved byte, nesting past the unpacker's stack, an integer key, a list as a key
    for raw in (b"", b"\xc1", b"\x91" * 100_000, packer.pack({1: 2}), b"\x81\x91\x01\x02"):
        with pytest.raises(BadRequest):
            parse_query(raw, book, "application/msgpack")


def test_token_bounds_and_encodings():
    book = FormatBook()
    book.add(engine())
    ok = parse_query(json.dumps({"model": "tiny", "token_ids": [0, 2**32 - 1]}).encode(), book)
    assert ok.n_tokens == 2 and ok.tokens == bytes(4) + b"\xff" * 4
    packed = parse_query(msgpack.packb({"model": "tiny", "token_ids": bytes(4) + b"\xff" * 4}), book,
                         "application/msgpack")
    listed = parse_query(msgpack.packb({"model": "tiny", "token_ids": [0, 2**32 - 1]}), book, "application/x-msgpack")
    assert packed.tokens == listed.tokens == ok.tokens
    with pytest.raises(BadRequest, match="little-endian uint32"):
        parse_query(msgpack.packb({"model": "tiny", "token_ids": b"\0" * 5}), book, "application/msgpack")
    for bad in ([2**32], [-1], [1.0], ["1"], [None]):
        with pytest.raises(BadRequest, match="index 0"):
            parse_query(json.dumps({"model": "tiny", "token_ids": bad}).encode(), book)
    with pytest.raises(BadRequest, match="whole number"):
        parse_query(json.dumps({"model": "tiny", "token_ids_b64": "AAAA"}).encode(), book)  # 3 bytes
    with pytest.raises(BadRequest, match="one of them"):
        parse_query(json.dumps({"model": "tiny", "token_ids": [1], "token_ids_b64": "AAAAAA=="}).encode(), book)
    with pytest.raises(BadRequest, match="application/json"):
        parse_query(b"{}", book, "application/x-www-form-urlencoded")
    with pytest.raises(BadRequest, match="sorted by offset"):
        parse_query(json.dumps({"model": "tiny", "token_ids": [1], "mm": [
            {"identifier": "a", "offset": 5, "length": 1}, {"identifier": "b", "offset": 2, "length": 1}]}).encode(),
            book)


# ---- formats ------------------------------------------------------------------------------------------


def test_formats_by_model_name_basename_and_label():
    book = FormatBook()
    a, b = engine("/models/a"), engine("/models/a", fps=(b"\2" * 16,))
    book.add(a)
    assert book.find("/models/a", None).label == format_label(C, a.fingerprint)
    assert book.find("a", None).model == "/models/a"  # the last path component
    book.add(b)
    with pytest.raises(BadRequest, match="matches 2 formats"):
        book.find("a", None)
    assert book.find("a", format_label(C, b.fingerprint)).rank_fingerprints == b.rank_fingerprints
    with pytest.raises(BadRequest) as e:
        book.find("b", None)
    assert e.value.status == 404
    label = format_label(C, a.fingerprint)
    assert a.fingerprint.hex()[:8] not in label and label.startswith(f"c{C}-")
    for i in range(MAX_FORMATS + 5):  # bounded: the oldest go first
        book.add(engine(f"/m/{i}", fps=(i.to_bytes(16, "little"),)))
    assert len(book) == MAX_FORMATS
    with pytest.raises(BadRequest):
        book.find("/models/a", None)
    assert all("fingerprint" not in json.dumps(f) for f in book.listing())


# ---- the answer -----------------------------------------------------------------------------------------


def _keys(tokens: list[int], salt: str | None = None) -> list[bytes]:
    return chunk_keys(tokens, C, extras=chunk_extras(len(tokens) // C, C, cache_salt=salt))


def test_per_tier_answers_under_the_hybrid_rule_and_the_cap():
    eng = engine(kinds=("full", "swa", "mamba"))
    fp = eng.fingerprint
    ready: set[Any] = set()
    disk = FakeDisk()
    up = UsablePrefix(service(ready, disk), Metrics())
    up.book.add(eng)
    tokens = list(range(100, 100 + 6 * C))  # exactly 6 chunks: a fresh engine takes 5 at most
    keys = _keys(tokens)
    for i in range(6):
        ready |= {(fp, 0, keys[i]), (fp, 1, keys[i])}
    ready |= {(fp, 2, keys[2]), (fp, 2, keys[5])}  # Mamba states after chunks 2 and 5
    for i in range(6):  # the disk holds everything, states after chunks 3 and 4 too
        for g, kind in enumerate(("full", "swa", "mamba")):
            disk.put((fp, g, keys[i]), kind)
    code, out = ask(up, {"model": "tiny", "token_ids": tokens})
    assert code == 200
    assert out["tiers"] == {"pool": 48, "disk": 80, "cluster": None}
    assert out["usable_tokens"] == 80 and out["prefix_tokens"] == 96
    disk.put((fp, 2, keys[4]), "full", 4096)  # a file of another layout: the engine's read would refuse it
    _, out = ask(up, {"model": "tiny", "token_ids": tokens})
    assert out["tiers"]["disk"] == 64 and out["usable_tokens"] == 64
    _, out = ask(up, {"model": "tiny", "token_ids": tokens, "tiers": ["pool"]})
    assert out["tiers"] == {"pool": 48, "disk": None, "cluster": None} and out["usable_tokens"] == 48
    _, out = ask(up, {"model": "tiny", "token_ids": [*tokens, 1]})  # one more token: all 6 chunks may hit
    assert out["usable_tokens"] == out["prefix_tokens"] == 96 and out["tiers"]["pool"] == 96
    # The sliding window: chunk 4's swa entry gone from both tiers; 96 needs [56, 96), chunks 3..5.
    ready.discard((fp, 1, keys[4]))
    del disk.held[(fp, 1, keys[4])]
    _, out = ask(up, {"model": "tiny", "token_ids": [*tokens, 1]})
    assert out["usable_tokens"] == 64  # the state after chunk 3 (disk) with the window [24, 64)
    _, salted = ask(up, {"model": "tiny", "token_ids": [*tokens, 1], "cache_salt": "t"})
    assert salted["usable_tokens"] == salted["prefix_tokens"] == 0


def test_tensor_parallel_needs_every_ranks_entry():
    eng = engine(fps=(b"\3" * 16, b"\4" * 16))
    ready: set[Any] = set()
    up = UsablePrefix(service(ready), Metrics())
    up.book.add(eng)
    tokens = list(range(3 * C + 1))
    keys = _keys(tokens)
    ready |= {(b"\3" * 16, 0, k) for k in keys} | {(b"\4" * 16, 0, k) for k in keys[:2]}
    _, out = ask(up, {"model": "tiny", "token_ids": tokens})
    assert out["usable_tokens"] == 32 and out["tiers"] == {"pool": 32, "disk": None, "cluster": None}


async def test_long_prompts_and_adapter_digests_are_answered_later(tmp_path):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    eng = engine()
    fp = eng.fingerprint
    ready: set[Any] = set()
    up = UsablePrefix(service(ready), Metrics())
    up.book.add(eng)
    from hkvd.transport.extras import read_adapter_digest

    digest = read_adapter_digest(str(adapter))
    assert digest
    tokens = list(range(5000 * C))  # more chunks than one slice
    lora = ("ad", str(adapter))
    keys = chunk_keys(tokens, C, extras=chunk_extras(len(tokens) // C, C, lora=lora, lora_digest=digest))
    ready |= {(fp, 0, k) for k in keys[:4321]}
    body = {"model": "tiny", "token_ids": tokens, "lora": {"name": "ad", "path": str(adapter)}}
    got = up.post(Request("POST", "/v1/usable_prefix", "", {}, json.dumps(body).encode()))
    assert not isinstance(got, Response)
    resp = await got  # type: ignore[misc]
    assert json.loads(resp.body)["usable_tokens"] == 4321 * C
    # The digest is cached now, and given explicitly it is used as is.
    small = {"model": "tiny", "token_ids": tokens[:10 * C + 1], "lora": {"name": "ad", "path": str(adapter)}}
    assert ask(up, small)[1]["usable_tokens"] == 10 * C
    small["lora"] = {"name": "ad", "path": str(adapter), "digest": "0" * 32}
    assert ask(up, small)[1]["usable_tokens"] == 0


# ---- the HTTP server ------------------------------------------------------------------------------------


async def _endpoint() -> HTTPEndpoint:
    ep = HTTPEndpoint(0, lambda: (True, "ok"), lambda: b"m 1\n")

    async def slow(req: Request) -> Response:
        await asyncio.sleep(0.05)
        return Response(200, "text/plain", b"slow " + req.body)

    def echo(req: Request) -> Response:
        return Response(200, "text/plain", b"echo " + req.body)

    ep.route("POST", "/slow", lambda req: slow(req))
    ep.route("POST", "/echo", echo)
    await ep.start()
    return ep


async def _read_responses(reader: asyncio.StreamReader, n: int) -> list[tuple[int, bytes, dict[str, str]]]:
    out = []
    for _ in range(n):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
        body = await reader.readexactly(int(headers["content-length"]))
        out.append((int(lines[0].split()[1]), body, headers))
    return out


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


async def test_keep_alive_pipelined_answers_come_in_request_order():
    ep = await _endpoint()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", ep.port)
        reqs = [_post("/slow" if i % 3 == 0 else "/echo", str(i).encode()) for i in range(30)]
        raw = b"".join(reqs)
        for i in range(0, len(raw), 7):  # split anywhere: heads and bodies across reads
            w.write(raw[i:i + 7])
        w.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        async with asyncio.timeout(10):
            got = await _read_responses(r, 31)
        assert [b.split()[-1] for _, b, _ in got[:30]] == [str(i).encode() for i in range(30)]
        assert got[30][:2] == (200, b"ok\n") and got[30][2]["connection"] == "keep-alive"
        w.write(_post("/echo", b"last", "Connection: close\r\n"))
        async with asyncio.timeout(10):
            (last,) = await _read_responses(r, 1)
            assert last[2]["connection"] == "close" and await r.read() == b""
        w.close()
    finally:
        await ep.close()


async def test_bounds_and_bad_requests_close_with_an_answer():
    ep = await _endpoint()

    async def one(raw: bytes) -> bytes:
        r, w = await asyncio.open_connection("127.0.0.1", ep.port)
        w.write(raw)
        async with asyncio.timeout(10):
            data = await r.read()
        w.close()
        return data

    try:
        assert (await one(f"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode())
                ).startswith(b"HTTP/1.0 413")
        assert (await one(b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
                ).startswith(b"HTTP/1.0 411")
        assert (await one(b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 2000 + b"\r\n")).startswith(b"HTTP/1.0 431")
        assert (await one(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n")).startswith(b"HTTP/1.0 400")
        assert (await one(b"GET /echo HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.0 405")
        assert (await one(b"GET /nope HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.0 404")
        # A head still arriving is bounded too; HTTP/1.1 without Host is refused (RFC 9112).
        assert (await one(b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 1500)).startswith(b"HTTP/1.0 431")
        no_host = await one(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert no_host.startswith(b"HTTP/1.0 400") and b"Host" in no_host
        # HTTP/1.0 closes after its answer; "Expect: 100-continue" gets its interim answer first.
        r, w = await asyncio.open_connection("127.0.0.1", ep.port)
        w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nExpect: 100-continue\r\n"
                b"Connection: close\r\n\r\n")
        async with asyncio.timeout(10):
            assert await r.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            w.write(b"abc")
            assert (await r.read()).endswith(b"echo abc")
        w.close()
    finally:
        await ep.close()


class FakeCluster:
    """A cluster tier: ``holds`` answers after ``delay_s`` (calls counted)."""

    def __init__(self, held: set[Any], delay_s: float = 0.01, budget_s: float = 1.0) -> None:
        self.held = held
        self.delay_s = delay_s
        self.budget_s = budget_s
        self.calls: list[int] = []

    def usable(self) -> bool:
        return True

    async def holds(self, keys: Any) -> set[Any]:
        self.calls.append(len(keys))
        await asyncio.sleep(self.delay_s)
        return {k for k in keys if k in self.held}


async def test_the_cluster_is_asked_once_per_batch_of_concurrent_requests_within_its_budget():
    eng = engine(kinds=("full", "mamba"))
    fp = eng.fingerprint
    tokens = [list(range(i * 1000, i * 1000 + 4 * C + 1)) for i in range(5)]
    held = set()
    for i, t in enumerate(tokens):
        keys = _keys(t)
        held |= {(fp, g, k) for g in (0, 1) for k in keys[:i]}  # prompt i: i chunks in the cluster
    ready = {(fp, 0, _keys(tokens[4])[0]), (fp, 1, _keys(tokens[4])[0])}  # prompt 4's first chunk in the pool too
    cluster = FakeCluster(held)
    up = UsablePrefix(service(ready, cluster=cluster), Metrics())
    up.book.add(eng)
    pending = [up.post(Request("POST", "/v1/usable_prefix", "", {}, json.dumps(
        {"model": "tiny", "token_ids": t}).encode())) for t in tokens]
    assert not any(isinstance(p, Response) for p in pending)  # the cluster's answer is awaited
    got = [json.loads(r.body) for r in await asyncio.gather(*pending)]  # type: ignore[arg-type]
    assert [g["tiers"]["cluster"] for g in got] == [0, 16, 32, 48, 64]
    assert [g["usable_tokens"] for g in got] == [0, 16, 32, 48, 64]
    assert got[4]["tiers"]["pool"] == 16
    assert len(cluster.calls) <= 2  # the first request's check, then one for all that came meanwhile
    # Not asked: the pool's answer at once, no cluster figure.
    quick = ask(up, {"model": "tiny", "token_ids": tokens[4], "tiers": ["pool"]})[1]
    assert quick["tiers"] == {"pool": 16, "disk": None, "cluster": None}
    # No answer within the tier's budget: the cluster's figure is null and the rest is answered.
    cluster.delay_s, cluster.budget_s = 1.0, 0.05
    slow = up.post(Request("POST", "/v1/usable_prefix", "", {}, json.dumps(
        {"model": "tiny", "token_ids": tokens[4]}).encode()))
    out = json.loads((await slow).body)  # type: ignore[misc]
    assert out["tiers"] == {"pool": 16, "disk": None, "cluster": None} and out["usable_tokens"] == 16


def test_a_partial_chunk_extends_the_answer_past_the_last_whole_chunk():
    from hkvd.transport.keys import partial_key

    eng = engine(kinds=("full", "mamba"))
    fp = eng.fingerprint
    ready: set[Any] = set()
    disk = FakeDisk()
    up = UsablePrefix(service(ready, disk), Metrics())
    up.book.add(eng)
    tokens = list(range(100, 100 + 3 * C + 8))  # 56 tokens: chunks 0-2 whole, 8 more
    keys = _keys(tokens)
    ready |= {(fp, 0, keys[0]), (fp, 0, keys[1]), (fp, 1, keys[1])}  # 32 tokens by whole chunks

    def partial(end: int) -> bytes:
        return partial_key(keys[1], tokens[2 * C:end])

    _, out = ask(up, {"model": "tiny", "token_ids": tokens})
    assert out["usable_tokens"] == out["tiers"]["pool"] == 32
    ready.add((fp, 1, partial(44)))  # the state at 44 without chunk 2's attention entry: no hit there
    _, out = ask(up, {"model": "tiny", "token_ids": tokens})
    assert out["usable_tokens"] == 32
    ready |= {(fp, 0, partial(44)), (fp, 0, partial(40)), (fp, 1, partial(40))}
    _, out = ask(up, {"model": "tiny", "token_ids": tokens})
    assert out["tiers"] == {"pool": 44, "disk": 0, "cluster": None}  # the longest; the disk holds nothing
    assert out["usable_tokens"] == out["prefix_tokens"] == 44
    _, out = ask(up, {"model": "tiny", "token_ids": tokens[:44]})  # 44 would leave no token to compute
    assert out["usable_tokens"] == 40 and out["prefix_tokens"] == 44
    _, out = ask(up, {"model": "tiny", "token_ids": tokens, "cache_salt": "t"})  # partial keys carry no extras
    assert out["usable_tokens"] == 0
    for g, kind in enumerate(("full", "mamba")):  # a partial chunk read from disk into the pool serves too
        disk.put((fp, g, partial(46)), kind)
    _, out = ask(up, {"model": "tiny", "token_ids": tokens})
    assert out["tiers"] == {"pool": 44, "disk": 0, "cluster": None} and out["usable_tokens"] == 46
    swa = engine(model="/m/swa", fps=(b"\2" * 16,), kinds=("full", "swa", "mamba"))
    up.book.add(swa)
    ready |= {(swa.fingerprint, g, k) for g in range(3) for k in (keys[0], keys[1], partial(44))}
    _, out = ask(up, {"model": "swa", "token_ids": tokens})
    assert out["usable_tokens"] == 32  # no partial chunks beside a sliding window
