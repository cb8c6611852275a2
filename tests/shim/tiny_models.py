# SPDX-License-Identifier: Apache-2.0
"""Tiny random-weight models and LoRA adapters for the shim's tests, built offline.

Role
    vLLM needs a model directory (config.json, weights, tokenizer) to start an engine. The
    shim's tests must not download anything, so this module builds tiny models with
    ``transformers`` + ``tokenizers`` from fixed seeds:

    - ``qwen3_next``: 3 Gated-DeltaNet layers + 1 full-attention layer. Linear head dim 128
      (vLLM's CPU GDN kernel refuses 32: "Unexpected head dim size, 32"), 4 KV heads x 128,
      so vLLM's hybrid block-size alignment picks block 128 (with 2 KV heads x 32 it picks
      1152 and no prompt of a few hundred tokens ever hits).
    - ``qwen3_next_tp2``: the same with 2 linear key heads and 4 value heads, so both kinds of heads
      split over two tensor-parallel ranks (vLLM then aligns the block size to 256).
    - ``gemma3``: 3 sliding-window layers (window 192) + 1 full-attention layer, head dim 32.
    - ``wide_kv``: a dense Llama whose KV cache is large for its compute: 8 full-attention layers
      of 8 KV heads x 128 (32 KiB of KV per token, as much as an 8B model's quarter) on a hidden
      size of 128, up to 8192 positions. A prefix of thousands of tokens is then a load of
      ~100 MiB and more, longer than a decode step: what the asynchronous-load tests and
      ``bench/load_overlap.py`` need.
    - ``deepseek_mla``: a DeepSeek-V2 with multi-head latent attention (MLA) and no MoE layer: 2 layers, 4 query
      heads (2 per rank at TP=2), a latent KV of 512 + 64 rope dims (the only size vLLM's CPU MLA kernel takes;
      its platform then forces block 16), so every rank's KV cache is the same latent page.
    - ``qwen3_next_think``: ``qwen3_next``'s weights and tokenizer with a reasoning model's chat template
      (``THINK_TEMPLATE``: an earlier answer's ``<think>...</think>`` part is not in the next prompt).
    - ``idefics3``: a vision-language model (``Idefics3ForConditionalGeneration``) whose image
      processor needs no torchvision. Vision tower: 1 layer, hidden 128, 64x64 images in 4x4
      patches, pixel shuffle 2, so one image is ``IDEFICS3_IMAGE_SEQ_LEN`` (64) ``<image>``
      tokens plus 3 wrapper tokens. Text model: Llama, 3 sliding-window layers (window 192) +
      1 full-attention layer, head dim 32; vLLM 0.32 CPU makes 4 KV-cache groups (3 sliding
      window, 1 full), block 128. Random images change the greedy tokens.

    ``build_lora`` writes a random PEFT LoRA adapter (rank 8, ``q_proj`` + ``v_proj`` of the
    text layers) for any of them by hand with ``safetensors``; ``B`` is not zero, so the
    adapter changes the outputs, and different seeds give different adapters.

    Models are ~1-3 MB. The same seed gives the same bytes, so a cold run and a warm run in two
    processes load identical weights.

Usage
    ``build(kind, root) -> Path`` builds once (a ``.complete`` marker makes it idempotent and
    safe against a half-written directory) and returns the model directory.
    ``build_lora(base_kind, name, seed, root) -> Path`` does the same for an adapter (under
    ``root/lora/<base_kind>/<name>``). Run as a script to build the models:
    ``python tests/shim/tiny_models.py /tmp/hkvd-models``.

    Image prompts for ``idefics3`` hold one ``IDEFICS3_IMAGE_TOKEN`` per image, e.g.
    ``{"prompt": "<image>the quick brown fox", "multi_modal_data": {"image": pil_image}}``.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

VOCAB_SIZE = 512
SEED = 1234
DEFAULT_ROOT = Path("/tmp/hkvd-models")
KINDS = ("qwen3_next", "gemma3", "idefics3", "qwen3_next_tp2", "wide_kv", "qwen3_next_think", "deepseek_mla")

# qwen3_next_think's chat template: ChatML turns, and an assistant message written before the last user
# message loses everything up to its last "</think>", as a reasoning model's template does (Qwen3's drops the
# thinking of the answers before the last user query), so the next turn's prompt never repeats it.
THINK_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set text = m.content -%}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in text -%}"
    "{%- set text = text.split('</think>')[-1].lstrip('\\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + text + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<think>\\n' -}}{%- endif -%}"
)

LORA_RANK = 8
LORA_ALPHA = 16
LORA_TARGETS = ("q_proj", "v_proj")
# Std of the random A and B entries: B @ A * alpha / r is then about as large as the base
# q/v weights (std 0.02), enough to flip greedy tokens of the random base model.
LORA_INIT_STD = 0.1

IDEFICS3_IMAGE_TOKEN = "<image>"
IDEFICS3_IMAGE_SIZE = 64
IDEFICS3_PATCH_SIZE = 4
IDEFICS3_SCALE_FACTOR = 2
IDEFICS3_IMAGE_SEQ_LEN = (IDEFICS3_IMAGE_SIZE // IDEFICS3_PATCH_SIZE) ** 2 // IDEFICS3_SCALE_FACTOR**2
# Weight init std. The default 0.02 gives greedy loops that barely depend on the image (two
# images differed in the first token only); 0.1 makes different images give different
# continuations. The model then emits EOS early: generate with ``ignore_eos=True``.
IDEFICS3_INIT_STD = 0.1
# Tokens Idefics3Processor looks up; all must be single tokens in the vocabulary.
_IDEFICS3_SPECIAL = [
    "<fake_token_around_image>",
    IDEFICS3_IMAGE_TOKEN,
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)),
]

# Words for the tokenizer's training corpus; the corpus only shapes the BPE merges. Tests feed
# token ids directly (TokensPrompt), so the exact merges do not matter beyond determinism.
_WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "cache", "block", "chunk", "state",
    "mamba", "window", "prefix", "token", "layer", "group", "engine", "daemon", "store", "retrieve",
    "lookup", "hybrid", "attention", "linear", "delta", "gated", "memory", "page", "stride", "offset",
    "region", "view", "boundary", "step", "event", "lease",
]


def _build_tokenizer(out: Path, extra_special: tuple[str, ...] | list[str] = ()):  # type: ignore[no-untyped-def]
    """Train the BPE tokenizer, save it to ``out`` and return it (``extra_special`` become
    single-token special tokens after the four base ones)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(SEED)
    corpus = [" ".join(rng.choice(_WORDS) for _ in range(40)) for _ in range(400)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>", *extra_special],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(out)
    return fast


def _common() -> dict:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "max_position_embeddings": 2048,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "tie_word_embeddings": False,
    }


def _config(kind: str):  # type: ignore[no-untyped-def]
    common = _common()
    if kind in ("qwen3_next", "qwen3_next_tp2"):
        from transformers import Qwen3NextConfig

        # qwen3_next_tp2: twice the linear-attention heads, so they split over two tensor-parallel ranks.
        linear = 2 if kind == "qwen3_next_tp2" else 1
        return Qwen3NextConfig(
            **common,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=128,
            linear_num_key_heads=linear,
            linear_num_value_heads=2 * linear,
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
    if kind == "deepseek_mla":
        from transformers import DeepseekV2Config

        return DeepseekV2Config(
            **common,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=32,
            first_k_dense_replace=2,  # every layer a dense MLP: no MoE
        )
    if kind == "wide_kv":
        from transformers import LlamaConfig

        return LlamaConfig(
            **{**common, "max_position_embeddings": 8192},
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=128,
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
    raise ValueError(f"unknown tiny model kind {kind!r}; use one of {KINDS}")


def _idefics3_config(image_token_id: int):  # type: ignore[no-untyped-def]
    from transformers import Idefics3Config, Idefics3VisionConfig, LlamaConfig

    text = LlamaConfig(
        **_common(),
        num_hidden_layers=4,
        layer_types=["sliding_attention"] * 3 + ["full_attention"],
        sliding_window=192,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        initializer_range=IDEFICS3_INIT_STD,
    )
    vision = Idefics3VisionConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=IDEFICS3_IMAGE_SIZE,
        patch_size=IDEFICS3_PATCH_SIZE,
        initializer_range=IDEFICS3_INIT_STD,
    )
    return Idefics3Config(
        text_config=text,
        vision_config=vision,
        image_token_id=image_token_id,
        scale_factor=IDEFICS3_SCALE_FACTOR,
        pad_token_id=3,
        tie_word_embeddings=False,
        initializer_range=IDEFICS3_INIT_STD,
    )


def _save_idefics3(out: Path) -> None:
    import torch
    from transformers import Idefics3ForConditionalGeneration, Idefics3Processor
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = _build_tokenizer(out, _IDEFICS3_SPECIAL)
    image_token_id = tokenizer.convert_tokens_to_ids(IDEFICS3_IMAGE_TOKEN)
    torch.manual_seed(SEED)
    model = Idefics3ForConditionalGeneration._from_config(_idefics3_config(image_token_id), dtype=torch.bfloat16)
    model.save_pretrained(out)
    # No splitting: every image is resized to one 64x64 tile, so it always costs the same
    # number of tokens whatever its size.
    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IDEFICS3_IMAGE_SIZE},
        max_image_size={"longest_edge": IDEFICS3_IMAGE_SIZE},
    )
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=IDEFICS3_IMAGE_SEQ_LEN)
    processor.save_pretrained(out)


def build(kind: str, root: Path = DEFAULT_ROOT) -> Path:
    """Build (once) and return the directory of the tiny model ``kind`` (one of ``KINDS``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; use one of {KINDS}")
    out = Path(root) / kind
    marker = out / ".complete"
    if marker.exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM

    if kind == "qwen3_next_think":
        import shutil

        shutil.copytree(build("qwen3_next", root), out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".complete"))
        tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
        tok_cfg["chat_template"] = THINK_TEMPLATE
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
        marker.write_text("ok\n")
        return out
    out.mkdir(parents=True, exist_ok=True)
    if kind == "idefics3":
        _save_idefics3(out)
    else:
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


def _lora_targets(base: Path) -> dict[str, tuple[int, int]]:
    """Base weight name prefix -> (out_features, in_features) for every LoRA target of the
    text model (vision-tower projections are left alone)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, int]] = {}
    for path in sorted(base.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                module, _, leaf = key.rpartition(".")
                if leaf != "weight" or "vision" in key or module.rpartition(".")[2] not in LORA_TARGETS:
                    continue
                out_f, in_f = f.get_slice(key).get_shape()
                shapes[module] = (out_f, in_f)
    if not shapes:
        raise ValueError(f"no {LORA_TARGETS} weights in {base}")
    return shapes


def build_lora(base_kind: str, name: str, seed: int, root: Path = DEFAULT_ROOT) -> Path:
    """Build (once) and return a random PEFT LoRA adapter for ``build(base_kind, root)``.

    Rank ``LORA_RANK`` on ``LORA_TARGETS``; A and B are drawn from ``seed`` (B is not zero).
    Rebuilding an existing ``name`` with another seed is an error.
    """
    import torch
    from safetensors.torch import save_file

    base = build(base_kind, root)
    out = Path(root) / "lora" / base_kind / name
    marker = out / ".complete"
    stamp = f"seed={seed}\n"
    if marker.exists():
        if marker.read_text() != stamp:
            raise ValueError(f"LoRA {out} exists with {marker.read_text().strip()}, not seed={seed}")
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for module, (out_f, in_f) in sorted(_lora_targets(base).items()):
        a = torch.randn(LORA_RANK, in_f, generator=gen) * LORA_INIT_STD
        b = torch.randn(out_f, LORA_RANK, generator=gen) * LORA_INIT_STD
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.to(torch.bfloat16).contiguous()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.to(torch.bfloat16).contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base),
        "r": LORA_RANK,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    marker.write_text(stamp)
    return out


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_ROOT
    for k in KINDS:
        print(build(k, root))
