# SPDX-License-Identifier: Apache-2.0
"""The worker registers every KV allocation vLLM 0.32 makes, and moves its pages byte-exact.

For a GDN hybrid (Qwen3-Next-like: N = 544, padded Mamba pages), an SWA hybrid (Gemma3-like), an
FP8 KV cache and an MLA cache, each ``KVCacheConfig`` comes from vLLM's own
``get_kv_cache_config_from_groups`` under every ``VLLM_KV_CACHE_LAYOUT``, and the caches from its
own ``allocate_kv_cache`` on CPU with the kernel block sizes ``prepare_kernel_block_sizes`` picks
for the sizes FlashInfer, FlashAttention and Triton declare (their declarations are stood in by
small classes: the backends themselves need a GPU). Two such engines with different block counts
register through ``WorkerSide`` with one real ``hkvd serve``; blocks stored from the first are
retrieved into other block ids of the second, and the second's whole buffer must then equal what
vLLM's own views say: those manager blocks copied, every other byte unchanged.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


class _Declares:
    """An attention backend's declared kernel block sizes (what prepare_kernel_block_sizes reads)."""

    sizes: list[Any] = []

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec: Any = None) -> list[Any]:
        return list(cls.sizes)

    @classmethod
    def get_name(cls) -> str:
        return cls.__name__


def _backends() -> dict[str, type]:
    from vllm.v1.attention.backend import MultipleOf

    return {
        "flashinfer": type("FlashInferSizes", (_Declares,), {"sizes": [16, 32, 64]}),
        "flash_attn_fixed": type("FlashAttnFixedSizes", (_Declares,), {"sizes": [16]}),  # FP8 on Hopper, hd 256
        "triton": type("TritonSizes", (_Declares,), {"sizes": [MultipleOf(16)]}),
    }


def _groups(model: str) -> tuple[int, list[Any]]:
    """(block size, KV-cache groups) of each model kind."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        KVQuantMode,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    if model == "gdn":  # Qwen3-Next-like: 1 full-attention layer per 3 GDN layers, N = 544
        attn = FullAttentionSpec(block_size=544, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
        mamba = MambaSpec(block_size=544, shapes=((3, 96), (2, 16, 16)), dtypes=(torch.bfloat16, torch.float32),
                          page_size_padded=attn.page_size_bytes, mamba_cache_mode="align")
        return 544, [KVCacheGroupSpec(["l3.attn"], attn), KVCacheGroupSpec(["l0.gdn", "l1.gdn", "l2.gdn"], mamba)]
    if model == "swa":  # Gemma3-like: sliding-window layers and a full-attention layer
        full = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
        swa = SlidingWindowSpec(block_size=64, num_kv_heads=2, head_size=32, dtype=torch.bfloat16, sliding_window=128)
        return 64, [KVCacheGroupSpec(["l0.swa", "l1.swa"], swa), KVCacheGroupSpec(["l2.full"], full)]
    if model == "fp8":
        spec = FullAttentionSpec(block_size=128, num_kv_heads=4, head_size=32, dtype=torch.float8_e4m3fn,
                                 kv_quant_mode=KVQuantMode.FP8_PER_TENSOR)
        return 128, [KVCacheGroupSpec(["l0", "l1"], spec)]
    assert model == "mla"  # one latent (kv_lora_rank + rope dim) per token and layer
    spec = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=96, dtype=torch.bfloat16)
    return 64, [KVCacheGroupSpec(["l0.mla", "l1.mla"], spec)]


class Engine:
    """One engine's KV caches, allocated by vLLM, registered through the shim's WorkerSide."""

    def __init__(self, vcfg: Any, model: str, layout: str, backend: type, num_blocks: int, socket: str) -> None:
        import torch
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import AttentionGroup, allocate_kv_cache, prepare_kernel_block_sizes

        from hkvd.shim.shim_config import ShimConfig
        from hkvd.shim.worker import WorkerSide

        block, groups = _groups(model)
        vcfg.cache_config.block_size = block
        vcfg.cache_config.kv_cache_layout = layout
        vcfg.cache_config.num_gpu_blocks_override = num_blocks
        self.kvc = get_kv_cache_config_from_groups(vcfg, groups, available_memory=1 << 40)
        self.kvc.kv_cache_layout = layout
        assert self.kvc.num_blocks == num_blocks
        attn_groups = [[AttentionGroup(backend, g.layer_names, g.kv_cache_spec, gid)] for gid, g in enumerate(groups)]
        self.kernel = prepare_kernel_block_sizes(self.kvc, attn_groups)
        self.layout = KVCacheLayout[layout]
        try:
            self.caches = allocate_kv_cache(self.kvc, torch.device("cpu"), self.layout, self.kernel)
        except ValueError as e:  # vLLM's own refusal: no connector ever sees this combination
            if "cannot be split" not in str(e):
                raise
            pytest.skip(f"vLLM refuses it itself: {e}")
        self.buf = next(iter(self.caches.values())).untyped_storage()
        gen = torch.Generator().manual_seed(num_blocks)
        self.raw = torch.empty(0, dtype=torch.int8).set_(self.buf)  # the whole backing allocation
        self.raw.copy_(torch.randint(-128, 128, (self.raw.numel(),), dtype=torch.int8, generator=gen))
        self.side = WorkerSide(vcfg, self.kvc, ShimConfig(socket_path=socket, require_daemon=True,
                                                           reconnect_interval_s=0.2))
        self.side.register_kv_caches(self.caches)
        assert self.side.link.client is not None, "the worker did not register with the daemon"

    def manager_page(self, name: str, block: int) -> Any:
        """vLLM's view of layer ``name``'s manager block ``block`` (kernel blocks grouped back)."""
        from vllm.v1.kv_cache_interface import group_kernel_blocks

        return group_kernel_blocks(self.caches[name], self.kvc.num_blocks)[block]

    def call(self, submit: Any) -> Any:
        client = self.side.link.client
        rid = submit(client)
        done = client.wait([rid], 10.0)[rid]
        assert done.ok, done.error
        return done

    def close(self) -> None:
        self.side.shutdown()


def _move(a: Engine, b: Engine, items_a: list[Any], items_b: list[Any]) -> None:
    """Store ``items_a`` from engine ``a`` (attention chunks as a store, Mamba states as a confirmed step
    event's offers), then retrieve them into ``b`` as ``items_b``."""
    from vllm.v1.kv_cache_interface import MambaSpec

    full = [it for it in items_a if not isinstance(a.kvc.kv_cache_groups[it[0]].kv_cache_spec, MambaSpec)]
    offers = [it for it in items_a if isinstance(a.kvc.kv_cache_groups[it[0]].kv_cache_spec, MambaSpec)]
    if full:
        a.call(lambda c: c.submit_store(full))
    if offers:
        ev = a.call(lambda c: c.submit_step_event(1, 1, offers))
        a.call(lambda c: c.submit_step_event(2, 2, [], [ev.req_id]))
    b.call(lambda c: c.submit_retrieve(items_b))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Any:
    import importlib
    import sys

    here = str(Path(__file__).resolve().parent)
    sys.path.insert(0, here)
    try:
        conftest = importlib.import_module("conftest")
    finally:
        sys.path.remove(here)
    d = conftest.Daemon(tmp_path_factory.mktemp("hkvd"), 128)
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def vcfg(tiny_lib: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, VllmConfig

    root = Path(os.environ.get("HKVD_TEST_MODELS") or tmp_path_factory.mktemp("models"))
    model = tiny_lib.build("gemma3", root)  # only its identity matters: the KV specs are built here
    return VllmConfig(model_config=ModelConfig(model=str(model), max_model_len=1024, dtype="bfloat16"),
                      cache_config=CacheConfig(block_size=64, enable_prefix_caching=True, mamba_cache_mode="align"),
                      device_config=DeviceConfig("cpu"))


CASES = [(m, lay, be) for m in ("gdn", "swa", "fp8", "mla") for lay in LAYOUTS
         for be in ("flashinfer", "flash_attn_fixed", "triton")]


@pytest.mark.parametrize(("model", "layout", "backend"), CASES, ids=["-".join(c) for c in CASES])
def test_store_and_retrieve_byte_exact(daemon: Any, vcfg: Any, model: str, layout: str, backend: str) -> None:
    from vllm.v1.kv_cache_interface import create_kv_cache_views, group_kernel_blocks

    be = _backends()[backend]
    a = Engine(vcfg, model, layout, be, 7, daemon.socket)
    b = Engine(vcfg, model, layout, be, 11, daemon.socket)
    try:
        assert a.kernel == b.kernel
        want = b.raw.clone()  # the expected buffer: B's bytes, then A's pages written through vLLM's views
        expected = {}
        for kvt in b.kvc.kv_cache_tensors:
            gid = next(i for i, g in enumerate(b.kvc.kv_cache_groups) if kvt.layers[0] in g.layer_names)
            expected.update(zip(kvt.layers, create_kv_cache_views(
                want, b.kvc.kv_cache_groups[gid].kv_cache_spec, b.kvc.num_blocks, b.layout, kvt, b.kernel[gid]),
                strict=True))
        # Groups alias each other's blocks (a block holds one group at a time): each group gets its own.
        moves = [{2: 9, 5: 3}, {1: 6}]  # per group: block of A -> block of B (B has more blocks)
        items_a, items_b = [], []
        for gid, g in enumerate(a.kvc.kv_cache_groups):
            for ba, bb in moves[gid].items():
                key = secrets.token_bytes(16)
                items_a.append([gid, 0, key, [ba]])
                items_b.append([gid, 0, key, [bb]])
                for name in g.layer_names:
                    group_kernel_blocks(expected[name], b.kvc.num_blocks)[bb].copy_(a.manager_page(name, ba))
        _move(a, b, items_a, items_b)
        assert b.raw.numpy().tobytes() == want.numpy().tobytes(), (
            f"{model}/{layout}/{backend} (kernel blocks {b.kernel}): B's buffer differs from vLLM's views")
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(("model", "layout", "backend", "ratio"), [
    ("gdn", "LBNHC", "flashinfer", 17), ("fp8", "LBHNC", "flash_attn_fixed", 8), ("swa", "LBHNC", "triton", 1)])
def test_matrix_covers_kernel_block_views(daemon: Any, vcfg: Any, model: str, layout: str, backend: str,
                                          ratio: int) -> None:
    """The attention views the worker gets count kernel blocks where the backend cannot take N."""
    e = Engine(vcfg, model, layout, _backends()[backend], 7, daemon.socket)
    try:
        attn = e.kvc.kv_cache_groups[0].layer_names[0]
        assert e.caches[attn].shape[0] == 7 * ratio
    finally:
        e.close()


def _worker(vcfg: Any, kvc: Any, socket: str) -> Any:
    from hkvd.shim.shim_config import ShimConfig
    from hkvd.shim.worker import WorkerSide

    return WorkerSide(vcfg, kvc, ShimConfig(socket_path=socket, reconnect_interval_s=0.2))


def test_a_tensor_that_is_not_vllms_allocation_is_refused(daemon: Any, vcfg: Any) -> None:
    """Shifted by a block, or strided unlike KVCacheConfig: refused, naming the layer and layout."""
    import torch

    e = Engine(vcfg, "swa", "LBNHC", _backends()["triton"], 7, daemon.socket)
    e.close()
    name = "l0.swa"
    good = e.caches[name]
    shifted = dict(e.caches)
    shifted[name] = torch.as_strided(good, good.shape, good.stride(), good.storage_offset() + good.stride(0))
    with pytest.raises(ValueError, match=r"layer l0\.swa \(KV-cache layout LBNHC\).*Remove the hkvd"):
        _worker(vcfg, e.kvc, daemon.socket).register_kv_caches(shifted)
    heads_outer = dict(e.caches)  # LBHNC's page order on an LBNHC config: the same bytes, another order
    heads_outer[name] = good.as_strided(good.shape, (good.stride(0), good.shape[2] * good.shape[3], good.shape[3], 1))
    with pytest.raises(ValueError, match=r"layer l0\.swa \(KV-cache layout LBNHC\)"):
        _worker(vcfg, e.kvc, daemon.socket).register_kv_caches(heads_outer)
    ok = _worker(vcfg, e.kvc, daemon.socket)
    ok.register_kv_caches(e.caches)
    ok.shutdown()


def test_too_scattered_pages_are_refused_with_a_fix_that_works(daemon: Any, vcfg: Any, monkeypatch: Any) -> None:
    """LHBNC splits a page into one piece per head; past MAX_PIECES the worker refuses and names layouts that
    keep a page whole, and the named fix registers."""
    from hkvd.shim import kv_views

    monkeypatch.setattr(kv_views, "MAX_PIECES", 2)  # the fp8 model has 4 KV heads
    with pytest.raises(ValueError, match=r"layer l0 \(KV-cache layout LHBNC\).*4 separate pieces.*LBHNC"):
        Engine(vcfg, "fp8", "LHBNC", _backends()["triton"], 7, daemon.socket)
    Engine(vcfg, "fp8", "LBHNC", _backends()["triton"], 7, daemon.socket).close()


def _logical(page: Any) -> Any:
    """A manager block's page of vLLM's view as its logical [H, N, C] bytes (kernel blocks joined back)."""
    import torch

    if page.dim() == 4:  # [k kernel blocks, H, N/k, C]
        page = page.permute(1, 0, 2, 3).reshape(page.shape[1], -1, page.shape[3])
    return page.contiguous().view(torch.int8)


SHARED = [  # (model, layout, backend) of the storing engine -> of the retrieving one
    (("fp8", "LBHNC", "flash_attn_fixed"), ("fp8", "LHBNC", "triton")),  # 8 kernel blocks -> heads outside blocks
    (("swa", "LBHNC", "flash_attn_fixed"), ("swa", "BLHNC", "triton")),
    (("fp8", "BLHNC", "flashinfer"), ("fp8", "BHLNC", "triton")),
    (("gdn", "LBHNC", "flash_attn_fixed"), ("gdn", "LBHNC", "triton")),  # 34 kernel blocks -> none
    (("fp8", "LBNHC", "flash_attn_fixed"), ("fp8", "BLNHC", "triton")),  # the token-outer family
]


@pytest.mark.parametrize(("src", "dst"), SHARED, ids=["-".join(s) + "->" + "-".join(d) for s, d in SHARED])
def test_entries_mean_the_same_across_layouts_and_kernel_splits(daemon: Any, vcfg: Any, src: tuple[str, ...],
                                                                dst: tuple[str, ...]) -> None:
    """An entry stored by an engine whose blocks are split into kernel blocks (and laid out one way) is retrieved
    by one with another split and layout under the same fingerprint: each moved block's logical [H, N, C] bytes
    through vLLM's views are the source's, and no other byte of the destination changes."""
    import torch
    from vllm.v1.kv_cache_interface import create_kv_cache_views, group_kernel_blocks

    a = Engine(vcfg, src[0], src[1], _backends()[src[2]], 7, daemon.socket)
    b = Engine(vcfg, dst[0], dst[1], _backends()[dst[2]], 11, daemon.socket)
    try:
        assert a.kernel != b.kernel or src[1] != dst[1]
        assert a.side.link.ack.fingerprint == b.side.link.ack.fingerprint, "one model, one entry format"
        want = b.raw.clone()
        expected = {}
        for kvt in b.kvc.kv_cache_tensors:
            gid = next(i for i, g in enumerate(b.kvc.kv_cache_groups) if kvt.layers[0] in g.layer_names)
            expected.update(zip(kvt.layers, create_kv_cache_views(
                want, b.kvc.kv_cache_groups[gid].kv_cache_spec, b.kvc.num_blocks, b.layout, kvt, b.kernel[gid]),
                strict=True))
        moves = [{2: 9, 5: 3}, {1: 6}]
        items_a, items_b = [], []
        for gid, g in enumerate(a.kvc.kv_cache_groups):
            for ba, bb in moves[gid].items():
                key = secrets.token_bytes(16)
                items_a.append([gid, 0, key, [ba]])
                items_b.append([gid, 0, key, [bb]])
                for name in g.layer_names:
                    dst_page = group_kernel_blocks(expected[name], b.kvc.num_blocks)[bb].view(torch.int8)
                    page = _logical(a.manager_page(name, ba))  # [H, N, C]
                    if dst_page.dim() == 4:  # [k, H, N/k, C]
                        page = page.reshape(dst_page.shape[1], dst_page.shape[0], dst_page.shape[2], -1).transpose(0, 1)
                    dst_page.copy_(page)
        _move(a, b, items_a, items_b)
        for gid, g in enumerate(b.kvc.kv_cache_groups):  # the logical content, through vLLM's own views
            for ba, bb in moves[gid].items():
                for name in g.layer_names:
                    assert _logical(b.manager_page(name, bb)).equal(_logical(a.manager_page(name, ba))), (
                        f"{name}: block {bb} of {dst} is not block {ba} of {src}")
        assert b.raw.numpy().tobytes() == want.numpy().tobytes(), "bytes outside the loaded blocks changed"
    finally:
        a.close()
        b.close()
