# SPDX-License-Identifier: Apache-2.0
"""Tiny random-weight hybrid models for the shim's tests, built offline.

Role
    vLLM needs a model directory (config.json, weights, tokenizer) to start an engine. The
    shim's tests must not download anything, so this module builds two tiny hybrids with
    ``transformers`` + ``tokenizers`` from fixed seeds:

    - ``qwen3_next``: 3 Gated-DeltaNet layers + 1 full-attention layer. Linear head dim 128
      (vLLM's CPU GDN kernel refuses 32: "Unexpected head dim size, 32"), 4 KV heads x 128,
      so vLLM's hybrid block-size alignment picks block 128 (with 2 KV heads x 32 it picks
      1152 and no prompt of a few hundred tokens ever hits).
    - ``gemma3``: 3 sliding-window layers (window 192) + 1 full-attention layer, head dim 32.

    Both are ~1-3 MB. The same seed gives the same bytes, so a cold run and a warm run in two
    processes load identical weights.

Usage
    ``build(kind, root) -> Path`` builds once (a ``.complete`` marker makes it idempotent and
    safe against a half-written directory) and returns the model directory. Run as a script to
    build both: ``python tests/shim/tiny_models.py /tmp/hkvd-models``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 512
SEED = 1234
DEFAULT_ROOT = Path("/tmp/hkvd-models")

# Words for the tokenizer's training corpus; the corpus only shapes the BPE merges. Tests feed
# token ids directly (TokensPrompt), so the exact merges do not matter beyond determinism.
_WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "cache", "block", "chunk", "state",
    "mamba", "window", "prefix", "token", "layer", "group", "engine", "daemon", "store", "retrieve",
    "lookup", "hybrid", "attention", "linear", "delta", "gated", "memory", "page", "stride", "offset",
    "region", "view", "boundary", "step", "event", "lease",
]


def _build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(SEED)
    corpus = [" ".join(rng.choice(_WORDS) for _ in range(40)) for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(out)


def _config(kind: str):  # type: ignore[no-untyped-def]
    common = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "tie_word_embeddings": False,
    }
    if kind == "qwen3_next":
        from transformers import Qwen3NextConfig

        return Qwen3NextConfig(
            **common,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=128,
            linear_num_key_heads=1,
            linear_num_value_heads=2,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if kind == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(
            **common,
            num_hidden_layers=4,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            sliding_window=192,
        )
    raise ValueError(f"unknown tiny model kind {kind!r}; use 'qwen3_next' or 'gemma3'")


def build(kind: str, root: Path = DEFAULT_ROOT) -> Path:
    """Build (once) and return the directory of the tiny model ``kind``."""
    out = Path(root) / kind
    marker = out / ".complete"
    if marker.exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    cfg = _config(kind)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    _build_tokenizer(out)
    # vLLM reads generation_config.json when present; make greedy decoding the only behaviour.
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3})
    )
    marker.write_text("ok\n")
    return out


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_ROOT
    for k in ("qwen3_next", "gemma3"):
        print(build(k, root))
