# SPDX-License-Identifier: Apache-2.0
"""Cache identity in real vLLM (CPU): what vLLM keeps apart, hkvd keeps apart.

Each engine runs in its own process (tests/shim/e2e_run.py) and resets vLLM's local prefix cache
before every prompt, so ``num_cached_tokens > 0`` can only come from hkvd. Every check pairs a
request that must miss with one that must hit, and the sanity check that the two identities really
compute different tokens (otherwise serving the wrong KV could go unseen).

- LoRA: adapter A's stored KV is never served to adapter B or the base model; A hits.
- ``cache_salt``: tenant b never gets tenant a's KV; the same salt hits.
- Weights: new weights at the same model path, after a daemon restart with the disk tier, get
  nothing; the old weights did hit after the same restart.
- Images: the same text with another image gets no cross hit; the same image hits.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

BLOCK = 128


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]


P1 = _seq(601, 7, 3)  # 4 full chunks + tail: a 512-token hit
P3 = _seq(900, 13, 1)  # 7 full chunks: an 896-token hit




def test_lora_adapters_and_cache_salts_never_share_kv(tiny_lib, outputs, models_root, daemon_factory,
                                                      engine_runner) -> None:
    base = tiny_lib.build("gemma3", models_root)
    a = str(tiny_lib.build_lora("gemma3", "lora_a", 11, models_root))
    b = str(tiny_lib.build_lora("gemma3", "lora_b", 22, models_root))
    d = daemon_factory(BLOCK)
    common = {"model": str(base), "socket": d.socket, "max_num_batched_tokens": BLOCK,
              "llm": {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}}
    lora_a, lora_b = ["lora_a", 1, a], ["lora_b", 2, b]

    cold = engine_runner({**common, "prompts": [{"ids": P1, "lora": lora_a}, {"ids": P3, "salt": "tenant-a"}]})
    assert outputs.hits(cold) == [0, 0], cold["log"][-3000:]

    warm = engine_runner({**common, "prompts": [
        {"ids": P1, "lora": lora_b},  # another adapter: no hit
        {"ids": P1},  # the base model: no hit
        {"ids": P1, "lora": lora_a},  # the same adapter: hits
        {"ids": P3, "salt": "tenant-b"},  # another tenant: no hit
        {"ids": P3},  # no salt: no hit
        {"ids": P3, "salt": "tenant-a"},  # the same tenant: hits
    ]})
    assert outputs.hits(warm) == [0, 0, 512, 0, 0, 896], warm["log"][-3000:]
    r = warm["results"]
    # The identities really compute different tokens, so wrong KV would have shown.
    assert r[0]["tokens"] != cold["results"][0]["tokens"] != r[1]["tokens"]
    outputs.compare(cold["results"][0], r[2], "adapter A, cold vs warm")
    outputs.compare(cold["results"][1], r[5], "tenant a, cold vs warm")


def _rewrite_weights(model_dir: Path, seed: int) -> None:
    """New random weights of the same shapes under the same path (a fine-tune landing in place)."""
    import torch
    from safetensors.torch import load_file, save_file

    gen = torch.Generator().manual_seed(seed)
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors = load_file(str(f))
        new = {k: (torch.randn(v.shape, generator=gen) * v.float().std().clamp(min=0.02)).to(v.dtype)
               for k, v in tensors.items()}
        save_file(new, str(f), metadata={"format": "pt"})


def test_new_weights_at_the_same_path_get_nothing_from_the_disk_tier(tiny_lib, outputs, models_root,
                                                                     daemon_factory, engine_runner,
                                                                     tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_lib.build("gemma3", models_root), model)
    d = daemon_factory(BLOCK, "--l2-path", str(tmp_path / "l2"), "--l2-size-gb", "1")
    common = {"model": str(model), "socket": d.socket, "max_num_batched_tokens": BLOCK}

    cold = engine_runner({**common, "prompts": [P1]})
    assert outputs.hits(cold) == [0], cold["log"][-3000:]
    d.restart()  # empty pool; the disk tier still has the entries
    again = engine_runner({**common, "prompts": [P1]})
    assert outputs.hits(again) == [512], again["log"][-3000:]  # served from disk: the path works
    outputs.compare(cold["results"][0], again["results"][0], "same weights after a restart")

    d.restart()
    _rewrite_weights(model, seed=99)
    new = engine_runner({**common, "prompts": [P1]})
    assert outputs.hits(new) == [0], new["log"][-3000:]
    assert new["results"][0]["tokens"] != cold["results"][0]["tokens"]  # the weights really changed


def test_images_never_share_kv(tiny_lib, outputs, models_root, daemon_factory, engine_runner) -> None:
    model = tiny_lib.build("idefics3", models_root)
    d = daemon_factory(BLOCK)
    common = {"model": str(model), "socket": d.socket, "max_num_batched_tokens": BLOCK, "ignore_eos": True,
              "llm": {"limit_mm_per_prompt": {"image": 1}}}
    # The image first (its 67 tokens in chunk 0), then ~300 words: 2 full chunks.
    words = [tiny_lib._WORDS[(i * 7) % len(tiny_lib._WORDS)] for i in range(300)]
    text = tiny_lib.IDEFICS3_IMAGE_TOKEN + " ".join(words)
    size = tiny_lib.IDEFICS3_IMAGE_SIZE
    img1 = {"text": text, "image": {"seed": 1, "size": size}}
    img2 = {"text": text, "image": {"seed": 2, "size": size}}

    cold = engine_runner({**common, "prompts": [img1]})
    assert outputs.hits(cold) == [0], cold["log"][-3000:]
    warm = engine_runner({**common, "prompts": [img2, img1]})
    other, same = outputs.hits(warm)
    assert other == 0, warm["log"][-3000:]  # another image: no chunk is shared
    assert same >= 2 * BLOCK and same % BLOCK == 0, warm["log"][-3000:]
    assert warm["results"][0]["tokens"] != cold["results"][0]["tokens"]  # the images really differ
    outputs.compare(cold["results"][0], warm["results"][1], "the same image, cold vs warm")
