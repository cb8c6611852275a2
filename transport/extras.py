"""The canonical encoding of vLLM's per-range extra keys, shared by the shim and the daemon.

Role
    A chunk key (``hkvd.transport.keys``) mixes in ``extra(i)``: the canonical bytes of whatever
    else besides the token ids changes the KV of chunk i's token range. vLLM 0.32 names those in
    ``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys``: ``("lora", name, path)`` on
    every range, ``("mm", identifier, offset)`` for every multimodal item overlapping the range
    (offset relative to the range's start), ``("cache_salt", salt)`` in the range that starts at
    token 0, ``("prompt_embeds", sha256)`` per range, in that order (lora, mm, salt, embeds).

    - ``encode_extra`` turns one range's tuple into bytes; a LoRA key gets the digest of the
      adapter's files appended (``adapter_digest``), so a rewritten adapter under the same name
      and path never shares an entry with the old one.
    - The shim builds the tuples with vLLM's own function (``hkvd.shim.identity``); the daemon,
      which runs without vLLM, rebuilds them from a router's request (LoRA, ``cache_salt``,
      multimodal items) with ``range_extra_keys``, a transcription of vLLM 0.32's rule, and
      ``chunk_extras``. Both sides then encode with ``encode_extra``: same request, same bytes.

    A tag or value type this module does not know raises ``Uncacheable``: such a request is never
    keyed by tokens alone.

Threading
    Pure functions; ``files_digest`` and ``adapter_digest`` read files (and cache their answers
    per process, as the shim needs); ``folder_digest`` is the uncached reading.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack

# The tags of vLLM 0.32's extra keys. Any other tag is a kind of identity hkvd does not know yet.
KNOWN_TAGS = ("lora", "mm", "cache_salt", "prompt_embeds")
EXTRA_FORMAT = b"hkvd-extra-1"
DIGEST_BYTES = 16
# Per weight file: this many evenly spaced samples of SAMPLE_BYTES, plus the last SAMPLE_BYTES.
SAMPLES = 16
SAMPLE_BYTES = 4096
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
INDEX_SUFFIX = ".index.json"


class Uncacheable(Exception):
    """A request hkvd cannot key safely; ``reason`` is a short label for counters and logs."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------- encoding


def encode_extra(extra: tuple[object, ...] | None, lora_digest: str = "") -> bytes:
    """The canonical bytes of one range's extra keys (b"" for none); raise ``Uncacheable`` if unknown."""
    if not extra:
        return b""
    parts: list[list[object]] = []
    for key in extra:
        if not isinstance(key, tuple) or not key or not isinstance(key[0], str):
            raise Uncacheable("unknown_extra_key", f"extra key {key!r} is not a tagged tuple")
        tag = key[0]
        if tag not in KNOWN_TAGS:
            raise Uncacheable(f"unknown_extra_key_{label(tag)}",
                              f"vLLM keys this request with a {tag!r} extra key, which this hkvd does not know")
        values = list(key)
        for v in values:
            if not isinstance(v, (str, bytes)) and (type(v) is not int):
                raise Uncacheable(f"extra_key_type_{label(type(v).__name__)}",
                                  f"a {tag!r} extra key holds a {type(v).__name__}, which has no canonical encoding")
        if tag == "lora":
            values.append(lora_digest)
        parts.append(values)
    return EXTRA_FORMAT + msgpack.packb(parts, use_bin_type=True)


def label(text: str) -> str:
    """``text`` as a counter label: lower-case ASCII letters, digits and ``_`` (the wire's rule)."""
    return "".join(c if c.isascii() and c.isalnum() else "_" for c in text.lower())[:32]


# --------------------------------------------------------------------------- vLLM's rule, without vLLM


@dataclass(frozen=True, slots=True)
class MMItem:
    """One multimodal item of a prompt: vLLM's ``MultiModalFeatureSpec.identifier`` and its
    placeholder range ``[offset, offset + length)`` in the prompt's tokens."""

    identifier: str
    offset: int
    length: int


def range_extra_keys(start: int, end: int, *, lora: tuple[str, str] | None, mm: Sequence[MMItem],
                     cache_salt: str | None, mm_idx: int = 0) -> tuple[tuple[tuple[str | int, ...], ...] | None, int]:
    """vLLM 0.32's ``generate_block_hash_extra_keys`` for tokens ``[start, end)`` of a request with
    these identities (and no prompt embeddings): ``(extra keys or None, next mm_idx)``.

    ``mm`` must be sorted by offset (vLLM sorts a request's items so); ``mm_idx`` is the scan hint
    the previous range returned (0 for the first), as vLLM and the shim pass it.
    """
    mm_keys: list[tuple[str | int, ...]] = []
    next_idx = mm_idx
    if mm and mm[-1].offset + mm[-1].length > start:
        i = mm_idx
        while i < len(mm):
            item = mm[i]
            if end > item.offset:
                if start >= item.offset + item.length:
                    i += 1  # the range is past this item
                    continue
                mm_keys.append(("mm", item.identifier, item.offset - start))
                if end >= item.offset + item.length:
                    i += 1  # the item ends in this range: the next one may start in it too
                else:
                    break
            else:
                break
        next_idx = i
    keys: list[tuple[str | int, ...]] = [("lora", lora[0], lora[1])] if lora else []
    keys += mm_keys
    if start == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return (tuple(keys) if keys else None), next_idx


def chunk_extras(n_chunks: int, chunk_size: int, *, lora: tuple[str, str] | None = None, lora_digest: str = "",
                 mm: Sequence[MMItem] = (), cache_salt: str | None = None) -> list[bytes] | None:
    """``extra(i)`` for chunks ``[0, n_chunks)``, as the shim computes them for a vLLM request with
    this LoRA adapter ``(name, path)`` (its files' digest ``lora_digest``), these multimodal items
    and this ``cache_salt``; None when the request has none of them (the token-only keys)."""
    if not (lora or mm or cache_salt):
        return None
    out = []
    mm_idx = 0
    for i in range(n_chunks):
        extra, mm_idx = range_extra_keys(i * chunk_size, (i + 1) * chunk_size, lora=lora, mm=mm,
                                         cache_salt=cache_salt, mm_idx=mm_idx)
        out.append(encode_extra(extra, lora_digest))
    return out


# --------------------------------------------------------------------------- file digests


@functools.cache
def adapter_digest(path: str) -> str:
    """Digest of a LoRA adapter's files ("" when the path is not a local folder: name and path only).

    Cached per process, once per path (the shim's engines load an adapter once)."""
    return files_digest(path) if path and Path(path).is_dir() else ""


def read_adapter_digest(path: str) -> str:
    """``adapter_digest`` read afresh, without the per-process cache."""
    return folder_digest(path) if path and Path(path).is_dir() else ""


@functools.cache
def files_digest(folder: str) -> str:
    """``folder_digest``, cached per process."""
    return folder_digest(folder)


def folder_digest(folder: str) -> str:
    """Digest of a model or adapter folder's config and weight files without reading them whole.

    Every ``*.json`` config or index file is hashed whole; every weight file contributes its name, its
    size, its safetensors header (names, dtypes, shapes, offsets) and ``SAMPLES`` evenly spaced
    ``SAMPLE_BYTES`` samples of its data plus its last bytes. Retrained or re-quantized weights change
    every sample; only an edit confined to a few unsampled bytes could go unseen.
    """
    root = Path(folder)
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for p in sorted(root.iterdir()):
        if not p.is_file():
            continue
        name = p.name
        if name.endswith(INDEX_SUFFIX) or name in ("config.json", "adapter_config.json"):
            h.update(b"json\0" + name.encode() + b"\0" + p.read_bytes())
        elif name.endswith(WEIGHT_SUFFIXES):
            h.update(b"weights\0" + name.encode() + b"\0")
            _sample_file(p, h)
    return h.hexdigest()


def _sample_file(path: Path, h: hashlib.blake2b) -> None:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(size.to_bytes(8, "little"))
        start = 0
        if path.suffix == ".safetensors" and size >= 8:
            n = int.from_bytes(f.read(8), "little")
            if 0 < n <= size - 8:
                h.update(f.read(n))
                start = 8 + n
        span = size - start
        if span <= 0:
            return
        step = max(span // SAMPLES, 1)
        for off in range(start, size, step):
            f.seek(off)
            h.update(f.read(SAMPLE_BYTES))
        f.seek(max(start, size - SAMPLE_BYTES))
        h.update(f.read(SAMPLE_BYTES))
