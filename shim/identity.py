# SPDX-License-Identifier: Apache-2.0
"""Cache identity: what besides the token ids decides the bytes of a chunk, and of an engine's entries.

Two questions decide whether an entry may be served:

- **Same engine format and weights?** ``engine_identity(vllm_config)`` digests everything that changes
  the bytes an engine writes for given tokens and is not already in the registered layout: the model's
  revision, its ``config.json``, a sample of its weight files (safetensors headers plus spread-out
  byte samples of every weight file, never a full read), the model and KV-cache dtypes, quantization,
  the attention backend setting, the device type and the TP/PP shape. The daemon mixes it into the
  engine's layout fingerprint, so new weights under the same path never see old entries (disk tier
  and peers included), while two engines of the same model and format still share.
- **Same prompt?** ``ChunkIdentity.extras`` turns vLLM's own per-range extra keys
  (``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys``: the LoRA adapter, the multimodal
  items overlapping the range with their offsets, the ``cache_salt`` in the first range, prompt-embedding
  digests) into one canonical byte string per chunk (``hkvd.transport.extras.encode_extra``, which the
  daemon shares to answer routers), which ``hkvd.transport.keys.chunk_keys`` mixes into the rolling
  key. vLLM's block hashes are not used: their seed is random per process. LoRA adapters are also
  keyed by a digest of their files, so re-pointing or rewriting an adapter under the same name and
  path never serves the old adapter's KV.

A request whose extra keys hkvd cannot encode safely (a tag or a value type it does not know) raises
``Uncacheable``: the scheduler side then neither looks it up nor stores it, counts it and logs the
reason once. It is never cached under a token-only key.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

# The canonical extra-key encoding and the file digests live in transport/ (the daemon computes the
# same keys for routers); the names stay importable from here.
from hkvd.transport.extras import (
    EXTRA_FORMAT,
    KNOWN_TAGS,
    SAMPLE_BYTES,
    SAMPLES,
    Uncacheable,
    adapter_digest,
    encode_extra,
    files_digest,
)

if TYPE_CHECKING:  # vLLM's types, for annotations only (vLLM is imported where it is used)
    from vllm.config import ModelConfig, VllmConfig
    from vllm.v1.request import Request

__all__ = ["EXTRA_FORMAT", "KNOWN_TAGS", "SAMPLES", "SAMPLE_BYTES", "ChunkIdentity", "Uncacheable", "adapter_digest",
           "encode_extra", "engine_identity", "files_digest", "model_identity", "prompt_tokens"]

logger = logging.getLogger("hkvd.shim")

_DIGEST = 16


# --------------------------------------------------------------------------- per-chunk extras


def prompt_tokens(request: Request) -> list[int]:
    """The prompt's token ids as vLLM hashes them (placeholders 0 where prompt embeddings stand)."""
    if getattr(request, "prompt_embeds", None) is not None:
        n = int(request.num_prompt_tokens)
        return list(request.all_token_ids[:n])
    return list(request.prompt_token_ids or [])


class ChunkIdentity:
    """Per-request extra bytes for each full chunk, from vLLM's own per-range extra keys."""

    def __init__(self) -> None:
        self._warned: set[str] = set()

    def extras(self, request: Request, chunk_size: int, n_chunks: int, first: int = 0) -> list[bytes] | None:
        """One entry per chunk of ``[first, n_chunks)`` (b"" where vLLM has no extra keys); None when the
        request has none at all. Chunks past the prompt (its output tokens) get the same kinds of keys
        vLLM gives its own blocks there: the LoRA adapter on every chunk, a multimodal item only where
        it overlaps, the ``cache_salt`` only in chunk 0."""
        if not _may_have_extras(request):
            return None
        try:
            from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
        except ImportError as e:  # a vLLM without the function: its identity rules are unknown to us
            raise Uncacheable("no_extra_key_function", f"vLLM has no generate_block_hash_extra_keys ({e})") from e
        lora = getattr(request, "lora_request", None)
        lora_digest = adapter_digest(str(getattr(lora, "lora_path", "") or "")) if lora else ""
        out = []
        mm_idx = 0  # vLLM's scan hint: items that end before a chunk are skipped, so 0 is right for any first
        for i in range(first, n_chunks):
            try:
                extra, mm_idx = generate_block_hash_extra_keys(request, i * chunk_size, (i + 1) * chunk_size, mm_idx)
            except Exception as e:
                raise Uncacheable("extra_keys_failed", f"{type(e).__name__}: {e}") from e
            out.append(encode_extra(extra, lora_digest))
        return out

    def note(self, request_id: str, exc: Uncacheable) -> None:
        """Log an uncacheable request: once per reason at WARNING, then at DEBUG."""
        if exc.reason in self._warned:
            logger.debug("hkvd: request %s is not cached (%s)", request_id, exc)
            return
        self._warned.add(exc.reason)
        logger.warning("hkvd: request %s is not cached and never will be served from hkvd: %s (logged once per "
                       "reason; counted as uncacheable_requests{reason=%s} in hkvd status)", request_id, exc.detail,
                       exc.reason)


def _may_have_extras(request: Request) -> bool:
    return bool(getattr(request, "lora_request", None) or getattr(request, "mm_features", None)
                or getattr(request, "cache_salt", None) or getattr(request, "prompt_embeds", None) is not None)


# --------------------------------------------------------------------------- engine identity


def engine_identity(vllm_config: VllmConfig) -> str:
    """Hex digest of what changes an engine's KV bytes beyond the registered layout (see module doc)."""
    return _digest(_identity_facts(vllm_config))


def model_identity(vllm_config: VllmConfig) -> str:
    """``engine_identity`` without the tensor-parallel size and the KV-cache dtype setting: engines of one model
    at different TP sizes share it, and the daemon may re-shard one's entries for the other
    (docs/design.md, "Entries across tensor-parallel sizes"). The cache's element type stays in each group's
    registered dtype, which the daemon compares: two worlds whose cache dtypes differ are told apart (and the
    refusal logged) there."""
    facts = _identity_facts(vllm_config)
    del facts["tp"], facts["kv_cache_dtype"]
    return _digest(facts)


def _digest(facts: dict[str, object]) -> str:
    blob = json.dumps(facts, sort_keys=True).encode()
    return hashlib.blake2b(blob, digest_size=_DIGEST).hexdigest()


def _identity_facts(vllm_config: VllmConfig) -> dict[str, object]:
    model_cfg = vllm_config.model_config
    cache = vllm_config.cache_config
    par = vllm_config.parallel_config
    attn = getattr(vllm_config, "attention_config", None)
    model_dir = _model_dir(model_cfg)
    facts: dict[str, object] = {
        "revision": str(getattr(model_cfg, "revision", None) or ""),
        "config": _config_digest(model_cfg, model_dir),
        "weights": files_digest(str(model_dir)) if model_dir is not None else _unresolved(str(model_cfg.model)),
        "dtype": str(getattr(model_cfg, "dtype", "")),
        "quantization": str(getattr(model_cfg, "quantization", None) or ""),
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", "")),
        "mamba_cache_dtype": str(getattr(cache, "mamba_cache_dtype", "")),
        "mamba_ssm_cache_dtype": str(getattr(cache, "mamba_ssm_cache_dtype", "")),
        "attention_backend": str(getattr(attn, "backend", None) or os.environ.get("VLLM_ATTENTION_BACKEND", "auto")),
        "attention_backend_per_kind": sorted((str(k), str(v)) for k, v in
                                             (getattr(attn, "backend_per_kind", None) or {}).items()),
        "platform": _platform(),
        "tp": int(getattr(par, "tensor_parallel_size", 1)),
        "pp": int(getattr(par, "pipeline_parallel_size", 1)),
    }
    return facts


def _platform() -> str:
    """The device type. Not the device's capability: the scheduler process may see no device, and both
    halves of the connector must compute the same identity (the page format is in the layout already)."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "unknown"
    return str(current_platform.device_type)


def _model_dir(model_cfg: ModelConfig) -> Path | None:
    path = Path(str(model_cfg.model))
    if path.is_dir():
        return path
    try:  # a hub id: the snapshot vLLM loaded, if it is in the local cache
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model_cfg.model), revision=getattr(model_cfg, "revision", None),
                                      local_files_only=True))
    except Exception:
        return None


def _config_digest(model_cfg: ModelConfig, model_dir: Path | None) -> str:
    if model_dir is not None and (model_dir / "config.json").is_file():
        return hashlib.blake2b((model_dir / "config.json").read_bytes(), digest_size=_DIGEST).hexdigest()
    hf = getattr(model_cfg, "hf_config", None)
    text = hf.to_json_string(use_diff=False) if hf is not None else ""
    return hashlib.blake2b(text.encode(), digest_size=_DIGEST).hexdigest()


@functools.cache
def _unresolved(model: str) -> str:
    logger.warning("hkvd: the files of model %s are not on this machine's disk; its cache entries are identified "
                   "by name, revision and config only, so serve new weights under a new name or revision", model)
    return "unresolved"
