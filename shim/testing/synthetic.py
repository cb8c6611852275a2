"""A synthetic engine: host KV memory laid out the way vLLM lays it out, driven through the client.

For tests, benchmarks and operators' smoke checks; no vLLM needed. Like vLLM 0.32+, the engine
allocates **one int8 buffer** and every group's views point into it, layer-major (LB**): layer l,
block b of a group lives at ``offset + l * layer_stride + b * block_stride``. Mamba groups may use
padded pages (``page_bytes < block_stride``), as vLLM pads state pages up to the attention page.

Run as a module for cross-process checks::

    python -m hkvd.shim.testing.synthetic --socket S store --tokens 1024 --seed 1
    python -m hkvd.shim.testing.synthetic --socket S fetch --tokens 1024 --seed 1   # prints JSON
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hkvd.shim.client import DaemonClient
from hkvd.shim.ptrace import allow_ptracer
from hkvd.shim.results import Completion
from hkvd.transport.copy_engine import Region
from hkvd.transport.keys import chunk_keys
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire.block_notes import BlockNote
from hkvd.transport.wire.control import EngineSpec, StateSplits
from hkvd.transport.wire.kv import Item, LookupReply, StoreResult

if TYPE_CHECKING:
    import multiprocessing.queues

    from hkvd.shim.pool_reads import PoolMaps


_ALIGN = 64  # bytes: torch's CPU tensors (c10's gAlignment)


@dataclass(frozen=True, slots=True)
class GroupShape:
    kind: str  # full | swa | mamba
    num_layers: int
    page_bytes: int
    block_stride: int = 0  # 0: == page_bytes (no padding)
    window_tokens: int = 0
    dtype: str = ""  # "": the engine's dtype (a Mamba group's: "state:<dtype>[shape];...")


class SyntheticEngine:
    """One engine rank with host KV memory, registered with a running daemon."""

    def __init__(self, socket_path: str, shapes: Sequence[GroupShape], *, num_blocks: int = 64,
                 tokens_per_block: int = 16, chunk_size: int = 0, model: str = "synthetic",
                 layout_tag: str = "host/LBHNC", timeout_s: float = 10.0, aliased: bool = False,
                 mamba_cache_mode: str = "align", world_size: int = 1, rank: int = 0, model_identity: str = "",
                 heads: Sequence[tuple[int, int, int, int]] = (), dtype: str = "bfloat16",
                 pool_maps: PoolMaps | None = None, states: Sequence[StateSplits] = ()) -> None:
        self.shapes = list(shapes)
        self.num_blocks = num_blocks
        self.tokens_per_block = tokens_per_block
        views: list[View] = []
        if aliased:
            # vLLM's hybrid layout: every group aliases the same layer slots of one buffer, one
            # block id space shared by all groups, pages padded up to the largest page.
            stride = max(s.block_stride or s.page_bytes for s in self.shapes)
            layer_stride = num_blocks * stride
            views = [View(0, 0, s.num_layers, layer_stride, stride, s.page_bytes) for s in self.shapes]
            size = max(s.num_layers for s in self.shapes) * layer_stride
        else:
            size = 0
            for s in self.shapes:
                stride = s.block_stride or s.page_bytes
                views.append(View(0, size, s.num_layers, num_blocks * stride, stride, s.page_bytes))
                size += s.num_layers * num_blocks * stride
        # 64-byte aligned, as torch's CPU allocator aligns an engine's KV caches: numpy's own buffer starts 16 bytes
        # past it (malloc's header), and the kernel's copy into such a buffer (rep movsb, process_vm_writev) ran at
        # 0.69 of the aligned one (32 x 2 MiB, 2-vCPU x86_64 VM, 2026-12-03), which a retrieve of a vLLM engine
        # never pays; glibc's memmove pays it for copies of 2 KiB to 1 MiB (0.41-0.49).
        raw = np.zeros(size + _ALIGN, dtype=np.int8)
        start = -int(raw.ctypes.data) % _ALIGN
        self.buffer = raw[start:start + size]
        self.groups = [
            GroupSpec(gid, s.kind, tokens_per_block, s.window_tokens, num_blocks, s.dtype or dtype, (v,))
            for gid, (s, v) in enumerate(zip(self.shapes, views, strict=True))
        ]
        self.client = DaemonClient(socket_path, client_name=f"synthetic-{os.getpid()}", role="worker",
                                   timeout_s=timeout_s)
        self.client.connect()
        allow_ptracer(self.client.daemon_pid)
        if pool_maps is not None:  # map the daemon's pool before registering, as a worker with in-step loads does
            self.client.mapped_pool = pool_maps.map(int(self.client.daemon_pid), self.client.server_id,
                                                    self.client.pool)
        region = Region(0, "host", self.buffer.nbytes, addr=self.buffer.ctypes.data)
        self.spec = EngineSpec(model, world_size, rank, layout_tag, chunk_size, tokens_per_block, 8192,
                               mamba_cache_mode, [region], self.groups, model_identity=model_identity,
                               heads=list(heads), states=list(states))
        ack = self.client.register(self.spec)
        self.ack = ack
        self.chunk_size = ack.chunk_size
        self.fingerprint = ack.fingerprint
        self.timeout_s = timeout_s

    # ---- memory --------------------------------------------------------------------------------
    def page(self, group_id: int, layer: int, block: int) -> np.ndarray:
        v = self.groups[group_id].views[0]
        start = v.offset + layer * v.layer_stride + block * v.block_stride
        return self.buffer[start:start + v.page_bytes]

    def block_bytes(self, group_id: int, block: int) -> bytes:
        return b"".join(self.page(group_id, layer, block).tobytes()
                        for layer in range(self.groups[group_id].views[0].num_layers))

    def fill_random(self, group_id: int, blocks: Sequence[int], seed: int) -> None:
        rng = np.random.default_rng(seed)
        for b in blocks:
            for layer in range(self.groups[group_id].views[0].num_layers):
                p = self.page(group_id, layer, b)
                p[:] = rng.integers(-128, 128, size=p.size, dtype=np.int8)

    def zero(self, group_id: int, blocks: Sequence[int]) -> None:
        for b in blocks:
            for layer in range(self.groups[group_id].views[0].num_layers):
                self.page(group_id, layer, b)[:] = 0

    # ---- descriptors ---------------------------------------------------------------------------
    def blocks_per_chunk(self) -> int:
        return self.chunk_size // self.tokens_per_block

    def items(self, group_id: int, keys: Sequence[bytes], first_block: int,
              chunks: Sequence[int] | None = None) -> list[Item]:
        """Items for chunks of ``keys`` on consecutive blocks starting at ``first_block``."""
        bpc = 1 if self.groups[group_id].kind == "mamba" else self.blocks_per_chunk()
        out = []
        for c in chunks if chunks is not None else range(len(keys)):
            out.append(Item(group_id, c, keys[c], [first_block + c * bpc + i for i in range(bpc)],
                            keys[c - 1] if c else b""))
        return out

    def run(self, req_id: int) -> Completion:
        c = self.client.wait([req_id], self.timeout_s)[req_id]
        if c.error is not None:
            raise c.error
        return c

    def store(self, items: Sequence[Item], notes: Sequence[BlockNote] | None = None) -> Completion:
        return self.run(self.client.submit_store(items, notes=notes))

    def retrieve(self, items: Sequence[Item], lease_id: int = 0) -> Completion:
        return self.run(self.client.submit_retrieve(items, lease_id))

    def lookup(self, keys: Sequence[bytes], lease: bool = True) -> tuple[int, int]:
        c = self.run(self.client.submit_lookup(keys, lease))
        found = c.get(LookupReply)
        return found.hit_chunks, found.lease_id

    def close(self) -> None:
        self.client.close()


def fetch_in_child(socket_path: str, shapes: list[GroupShape], engine_kw: dict[str, Any],
                   keys: list[bytes], items: list[Item],
                   out: multiprocessing.queues.Queue[dict[str, object]]) -> None:
    """Child-process body: a fresh engine of the same layout looks up ``keys``, retrieves ``items``
    into its own (zeroed) memory, and reports the hit and the bytes of every block it loaded."""
    eng = SyntheticEngine(socket_path, shapes, **engine_kw)
    hit, lease = eng.lookup(keys)
    try:
        if hit:
            eng.retrieve(items, lease)
        out.put({"hit_chunks": hit, "blocks": {(it.group_id, b): eng.block_bytes(it.group_id, b)
                                               for it in items for b in it.block_ids}})
    except Exception as e:  # report, do not hang the parent
        out.put({"hit_chunks": hit, "error": repr(e)})
    finally:
        eng.close()


def block_notes(keys: Sequence[bytes], tokens: Sequence[int], chunk_size: int, block_size: int,
                *, salt: str = "") -> list[BlockNote]:
    """Notes for KV events as the shim sends them, for chunks ``keys`` of ``tokens``. The block hashes
    stand in for vLLM's: a chained blake2b of the block's tokens (and ``salt``, in the first block),
    as unsigned 64-bit integers (vLLM's default event representation)."""
    out = []
    prev = b""
    per = chunk_size // block_size
    for c, key in enumerate(keys):
        hashes: list[bytes | int] = []
        parent = int.from_bytes(prev[:8], "big") if prev else None
        for b in range(c * per, (c + 1) * per):
            h = hashlib.blake2b(prev, digest_size=8)
            h.update(np.asarray(tokens[b * block_size:(b + 1) * block_size], dtype="<u4").tobytes())
            if b == 0 and salt:
                h.update(salt.encode())
            prev = h.digest()
            hashes.append(int.from_bytes(prev, "big"))
        chunk = np.asarray(tokens[c * chunk_size:(c + 1) * chunk_size], dtype="<u4").tobytes()
        out.append(BlockNote(key, hashes, parent, chunk, None, None, None))
    return out


def prompt_tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 50_000, size=n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hkvd.shim.testing.synthetic")
    p.add_argument("--socket", required=True)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--page-bytes", type=int, default=4096)
    p.add_argument("--model", default="synthetic")
    p.add_argument("--chunk-size", type=int, default=0)
    p.add_argument("op", choices=["store", "fetch", "store-forever"])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    eng = SyntheticEngine(a.socket, [GroupShape("full", a.layers, a.page_bytes)], num_blocks=256,
                          chunk_size=a.chunk_size, model=a.model)
    keys = chunk_keys(prompt_tokens(a.tokens, a.seed), eng.chunk_size)
    items = eng.items(0, keys, first_block=1)
    blocks = [b for it in items for b in it.block_ids]
    if a.op in ("store", "store-forever"):
        eng.fill_random(0, blocks, a.seed)
        if a.op == "store-forever":  # for kill -9 tests: keep storing until killed
            print(json.dumps({"ready": True}), flush=True)
            while True:
                eng.client.submit_store(items)
                eng.client.poll(0.001)
        c = eng.store(items)
        digest = [eng.block_bytes(0, b).hex()[:32] for b in blocks]
        print(json.dumps({"stored": c.get(StoreResult).stored, "digest": digest}))
        return 0
    hit, lease = eng.lookup(keys)
    if hit:
        eng.retrieve(items[:hit], lease)
    digest = [eng.block_bytes(0, b).hex()[:32] for it in items[:hit] for b in it.block_ids]
    print(json.dumps({"hit_chunks": hit, "chunks": len(keys), "digest": digest}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
