"""Cache identity: extra keys land in exactly the chunks vLLM keys with them, keys are stable across
processes, unknown identity is never cached, and the engine identity follows the weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hkvd.shim.identity import ChunkIdentity, Uncacheable, encode_extra, files_digest
from hkvd.transport.keys import chunk_keys

C = 16  # tokens per chunk in these tests


def _request(n_tokens: int, *, mm: list[tuple[str, int, int]] = (), lora: tuple[str, str] | None = None,
             salt: str | None = None):  # type: ignore[no-untyped-def]
    """A real vLLM Request (vLLM's own extra-key function reads it)."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.v1.request import Request

    feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                   mm_position=PlaceholderRange(offset=off, length=length))
             for ident, off, length in mm]
    lr = LoRARequest(lora[0], 1, lora[1]) if lora else None
    return Request("r", list(range(n_tokens)), SamplingParams(max_tokens=1), None, mm_features=feats or None,
                   lora_request=lr, cache_salt=salt)


def test_images_change_exactly_the_chunks_they_overlap():
    ident = ChunkIdentity()
    # image "a" covers tokens [20, 40): chunks 1 and 2; image "b" covers [64, 65): chunk 4 only.
    req = _request(6 * C, mm=[("a" * 64, 20, 20), ("b" * 64, 64, 1)])
    extras = ident.extras(req, C, 6)
    assert extras is not None
    assert [bool(x) for x in extras] == [False, True, True, False, True, False]
    assert extras[1] != extras[2]  # the image's offset relative to each chunk differs
    # Another image at the same place changes those chunks' extras and nothing else.
    other = ident.extras(_request(6 * C, mm=[("c" * 64, 20, 20), ("b" * 64, 64, 1)]), C, 6)
    assert other is not None
    assert [x != y for x, y in zip(extras, other, strict=True)] == [False, True, True, False, False, False]
    # In the keys: chunk 0 is shared, every key from chunk 1 on differs (the key is a rolling hash).
    toks = list(range(6 * C))
    ka, kb = chunk_keys(toks, C, extras=extras), chunk_keys(toks, C, extras=other)
    assert ka[0] == kb[0] == chunk_keys(toks, C)[0]
    assert all(x != y for x, y in zip(ka[1:], kb[1:], strict=True))


def test_lora_salt_and_plain_requests_get_distinct_keys():
    ident = ChunkIdentity()
    toks = list(range(4 * C))
    plain = ident.extras(_request(4 * C), C, 4)
    assert plain is None  # no extra keys at all: the token-only key
    a = ident.extras(_request(4 * C, lora=("a", "/nonexistent/a")), C, 4)
    b = ident.extras(_request(4 * C, lora=("b", "/nonexistent/b")), C, 4)
    s1 = ident.extras(_request(4 * C, salt="t1"), C, 4)
    s2 = ident.extras(_request(4 * C, salt="t2"), C, 4)
    assert a is not None and all(a)  # the adapter marks every chunk
    assert s1 is not None and [bool(x) for x in s1] == [True, False, False, False]  # the salt only the first
    keys = {name: tuple(chunk_keys(toks, C, extras=e)) for name, e in
            (("plain", plain), ("a", a), ("b", b), ("s1", s1), ("s2", s2))}
    firsts = {k[0] for k in keys.values()}
    lasts = {k[-1] for k in keys.values()}
    assert len(firsts) == len(lasts) == 5
    assert tuple(chunk_keys(toks, C, extras=ident.extras(_request(4 * C, salt="t1"), C, 4))) == keys["s1"]


def test_lora_adapter_files_are_part_of_its_key(tmp_path: Path):
    ident = ChunkIdentity()
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (d / "adapter_model.safetensors").write_bytes(_safetensors(b"\x01" * 4096))
    before = ident.extras(_request(2 * C, lora=("a", str(d))), C, 2)
    files_digest.cache_clear()
    from hkvd.shim import identity

    identity.adapter_digest.cache_clear()
    (d / "adapter_model.safetensors").write_bytes(_safetensors(b"\x02" * 4096))  # new weights, same name and path
    after = ident.extras(_request(2 * C, lora=("a", str(d))), C, 2)
    assert before != after


def test_unknown_identity_is_uncacheable():
    with pytest.raises(Uncacheable) as e:
        encode_extra((("adapter_v2", "x"),))
    assert e.value.reason == "unknown_extra_key_adapter_v2"
    with pytest.raises(Uncacheable) as e:
        encode_extra((("mm", "h", 1.5),))
    assert e.value.reason == "extra_key_type_float"
    with pytest.raises(Uncacheable):
        encode_extra(("mm",))  # not a tuple of tuples
    assert encode_extra(None) == b"" and encode_extra(()) == b""


def test_failing_extra_key_function_is_uncacheable():
    req = _request(2 * C, mm=[("a" * 64, 3, 4)])
    req.mm_features[0].identifier = None  # vLLM asserts on it
    with pytest.raises(Uncacheable) as e:
        ChunkIdentity().extras(req, C, 2)
    assert e.value.reason == "extra_keys_failed"


_KEYS_SCRIPT = """
import sys
from hkvd.shim.identity import encode_extra
from hkvd.transport.keys import chunk_keys
extras = [encode_extra((("lora", "a", "/p"), ("mm", "f" * 64, 3), ("cache_salt", "t"))), b"",
          encode_extra((("prompt_embeds", bytes(range(32))),))]
print(",".join(k.hex() for k in chunk_keys(list(range(48)), 16, extras=extras)))
"""


@pytest.mark.out_of_process
def test_keys_are_stable_across_processes():
    outs = set()
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", _KEYS_SCRIPT], env=env, capture_output=True, text=True,
                                check=True, timeout=60).stdout.strip())
    assert len(outs) == 1
    keys = outs.pop().split(",")
    assert len(keys) == 3 and len(set(keys)) == 3
    assert keys[0] != chunk_keys(list(range(48)), 16)[0].hex()


def test_weights_digest_follows_the_bytes_not_the_path(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"hidden_size": 8}))
        (d / "model.safetensors").write_bytes(_safetensors(bytes(range(256)) * 256))
    assert files_digest(str(a)) == files_digest(str(b))  # same files at two paths: shared
    c = tmp_path / "c"
    c.mkdir()
    (c / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (c / "model.safetensors").write_bytes(_safetensors(bytes(range(255, -1, -1)) * 256))  # same header
    assert files_digest(str(c)) != files_digest(str(a))


def _safetensors(data: bytes) -> bytes:
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}).encode()
    return len(header).to_bytes(8, "little") + header + data


def test_data_parallel_replicas_share_and_tensor_parallel_sizes_do_not(tmp_path: Path):
    """DP replicas are separate engines of one format: the same identity and world, so they share entries."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from vllm.config import ParallelConfig

    from hkvd.shim.identity import engine_identity

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (tmp_path / "model.safetensors").write_bytes(_safetensors(bytes(64)))

    def cfg(par: ParallelConfig) -> SimpleNamespace:
        model = SimpleNamespace(model=str(tmp_path), revision=None, dtype="bfloat16", quantization=None)
        cache = SimpleNamespace(cache_dtype="auto", mamba_cache_dtype="auto", mamba_ssm_cache_dtype="auto")
        return SimpleNamespace(model_config=model, cache_config=cache, parallel_config=par, attention_config=None)

    dp0 = ParallelConfig(data_parallel_size=2, data_parallel_rank=0)
    dp1 = ParallelConfig(data_parallel_size=2, data_parallel_rank=1)
    tp2 = ParallelConfig(tensor_parallel_size=2)
    assert dp0.world_size == dp1.world_size == 1  # the rank/world the shim registers
    assert engine_identity(cfg(dp0)) == engine_identity(cfg(dp1))
    assert engine_identity(cfg(tp2)) != engine_identity(cfg(dp0))
