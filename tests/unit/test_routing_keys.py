"""The daemon computes the shim's chunk keys for a router's request: for random prompts with LoRA adapters,
``cache_salt``s and multimodal items, the keys of ``hkvd.daemon.routing.usable_prefix`` (no vLLM) equal
the shim's (``hkvd.shim.identity``, through vLLM's own ``generate_block_hash_extra_keys``), byte for byte."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hkvd.daemon.cache.hybrid import GroupRule
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.routing.usable_prefix import UsablePrefix, parse_query
from hkvd.shim.identity import ChunkIdentity
from hkvd.transport.extras import read_adapter_digest
from hkvd.transport.keys import chunk_keys


def _request(tokens: list[int], mm: list[tuple[str, int, int]], lora: tuple[str, str] | None,
             salt: str | None) -> Any:
    """What vLLM's extra-key function reads of a Request, and nothing more."""
    feats = [SimpleNamespace(identifier=i, mm_position=SimpleNamespace(offset=o, length=n)) for i, o, n in mm]
    return SimpleNamespace(request_id="r", prompt_token_ids=tokens, mm_features=feats or None,
                           lora_request=SimpleNamespace(lora_name=lora[0], lora_path=lora[1]) if lora else None,
                           cache_salt=salt, prompt_embeds=None)


def _daemon(chunk_size: int) -> UsablePrefix:
    eng = SimpleNamespace(spec=SimpleNamespace(model="m"), chunk_size=chunk_size, fingerprint=b"\1" * 16,
                          rank_fingerprints=(b"\1" * 16,), world_fingerprints=(b"\1" * 16,),
                          rules=[GroupRule(0, "full")], kinds={0: "full"}, entry_bytes={0: 1})
    up = UsablePrefix(SimpleNamespace(index=None, disk=None, cluster=None), Metrics())
    up.book.add(eng)  # type: ignore[arg-type]
    return up


def test_daemon_keys_equal_shim_keys(tmp_path: Path):
    pytest.importorskip("vllm")
    adapters = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps({"r": 8, "name": name}))
        (d / "adapter_model.safetensors").write_bytes(b"\0" * 8 + name.encode() * 5000)
        adapters.append((name, str(d)))
    adapters.append(("remote", "org/adapter-on-the-hub"))  # not a folder here: keyed by name and path
    rng = random.Random(2026)
    ident = ChunkIdentity()
    compared = 0
    for case in range(300):
        C = rng.choice([4, 16, 128])
        n_tokens = rng.randrange(1, 12 * C)
        tokens = [rng.randrange(0, 1 << 32) for _ in range(n_tokens)]
        mm: list[tuple[str, int, int]] = []
        pos = 0
        while rng.random() < 0.6 and pos < n_tokens:
            pos += rng.randrange(0, 3 * C)
            length = rng.randrange(1, 3 * C)
            mm.append((f"{rng.getrandbits(64):016x}", pos, length))
            pos += length if rng.random() < 0.8 else 0  # sometimes two items start together
        lora = rng.choice([None, *adapters])
        salt = rng.choice([None, "", "tenant-1", "tenant-2", "tenant-ü"])
        req = _request(tokens, mm, lora, salt)
        n = n_tokens // C
        shim = chunk_keys(tokens, C, extras=ident.extras(req, C, n))
        body: dict[str, Any] = {"model": "m", "token_ids": tokens}
        if salt is not None:
            body["cache_salt"] = salt
        if lora:
            body["lora"] = {"name": lora[0], "path": lora[1]}
        if mm:
            body["mm"] = [{"identifier": i, "offset": o, "length": k} for i, o, k in mm]
        up = _daemon(C)
        q = parse_query(json.dumps(body).encode(), up.book)
        daemon = up.keys(q, read_adapter_digest(lora[1]) if lora else "").all()
        assert daemon == shim, (case, C, n_tokens, mm, lora, salt)
        compared += n
    assert compared > 1000


def test_the_comparison_sees_a_difference():
    """The daemon's keys differ from the shim's when the request differs in any extra the shim keys by."""
    pytest.importorskip("vllm")
    ident = ChunkIdentity()
    C = 16
    tokens = list(range(4 * C))
    req = _request(tokens, [("img", 20, 8)], ("a", "/nowhere/a"), "s")
    shim = chunk_keys(tokens, C, extras=ident.extras(req, C, 4))
    base = {"model": "m", "token_ids": tokens, "cache_salt": "s", "lora": {"name": "a", "path": "/nowhere/a"},
            "mm": [{"identifier": "img", "offset": 20, "length": 8}]}
    up = _daemon(C)
    assert up.keys(parse_query(json.dumps(base).encode(), up.book), "").all() == shim
    for change in ({"cache_salt": "t"}, {"lora": {"name": "b", "path": "/nowhere/a"}},
                   {"mm": [{"identifier": "img", "offset": 21, "length": 8}]},
                   {"mm": [{"identifier": "img", "offset": 20, "length": 30}]}):
        other = up.keys(parse_query(json.dumps({**base, **change}).encode(), up.book), "").all()
        assert other != shim, change
