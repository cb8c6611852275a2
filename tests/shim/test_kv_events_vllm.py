# SPDX-License-Identifier: Apache-2.0
"""KV events in real vLLM (CPU): hkvd names what it holds with vLLM's own block hashes.

One engine per model (tests/shim/kv_events_run.py) runs with vLLM's KV events on (``kv_events_config``,
publisher zmq on loopback ports) and the hkvd connector, beside a daemon publishing node-wide
(``--kv-events-endpoint``). Both of hkvd's paths are read back through replay sockets and decoded
with vLLM's classes:

- the connector's: hkvd's events in the engine's own stream, beside vLLM's GPU events;
- the daemon's: the node-level publisher.

For the same tokens, every hash hkvd announces equals the hash vLLM announces for its own GPU block,
with the same parent and token ids, and hkvd's group index, kind and window equal vLLM's. The
full-attention (and, for Qwen3-Next, every Mamba/GDN) group announces exactly the blocks vLLM
caches; a sliding-window group announces a superset (hkvd keeps blocks vLLM drops out of the window).

Salts: a salted prompt is announced under the hashes vLLM computes with the salt only. The test
plays the router's indexer and recomputes the hashes itself with vLLM's hash function: that needs
the engine's hash seed. vLLM seeds its block-hash chain from ``PYTHONHASHSEED`` when it is set
(else a fixed seed for sha256, a random one for xxhash), so the engine runs with a known
``PYTHONHASHSEED`` and the test seeds its own computation with it, as every indexer of a fleet must.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

HERE = Path(__file__).resolve().parent
BLOCK = 128
HASH_SEED = "20260501"  # PYTHONHASHSEED of the engine and of the test's own hashing (see the module doc)
SALT = "tenant-a"
MASK64 = (1 << 64) - 1
UNIT = 32  # prefix_match_unit of the qwen3_next_unit case


def _seq(n: int, mul: int, add: int) -> list[int]:
    return [(i * mul + add) % 500 + 4 for i in range(n)]


PROMPT = _seq(700, 7, 3)  # 5 full blocks; 100 more tokens are generated (and stored: 6 blocks)
SALTED = _seq(400, 13, 1)  # 3 full blocks, no token block in common with PROMPT


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(args: dict[str, Any], timeout_s: float = 600) -> dict[str, Any]:
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("HKVD_TEST_OMP_BIND", "0-1"),
               HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", PYTHONHASHSEED=HASH_SEED)
    out = subprocess.run([sys.executable, str(HERE / "kv_events_run.py"), json.dumps(args)], capture_output=True,
                         text=True, env=env, timeout=timeout_s, check=False)
    for line in out.stdout.splitlines():
        if line.startswith("HKVD_RESULT "):
            return json.loads(line[len("HKVD_RESULT "):])
    raise AssertionError(f"engine run failed (rc {out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-6000:]}")


def _replay(endpoint: str) -> list[bytes]:
    import zmq

    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(10_000), "the daemon's replay socket did not answer"
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                return out
            out.append(payload)
    finally:
        ctx.destroy(linger=0)


def _events(payloads: list[bytes]) -> list[Any]:
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    return [e for p in payloads for e in dec.decode(p).events]


def _blocks(events: list[Any]) -> list[tuple[int, Any, Any, tuple[int, ...]]]:
    """(group, hash, parent, token ids) of every block the BlockStored events name."""
    from vllm.distributed.kv_events import BlockStored

    out = []
    for e in events:
        if not isinstance(e, BlockStored):
            continue
        for j, h in enumerate(e.block_hashes):
            parent = e.parent_block_hash if j == 0 else e.block_hashes[j - 1]
            out.append((e.group_idx, h, parent, tuple(e.token_ids[j * e.block_size:(j + 1) * e.block_size])))
    return out


def _stored_type() -> Any:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored


def _indexer_hashes(tokens: list[int], salt: str | None, monkeypatch: pytest.MonkeyPatch,
                    unit: int | None = None) -> list[int]:
    """What a router's indexer computes for the full blocks of ``tokens``: vLLM's chain, as published. With
    ``prefix_match_unit`` the chain runs over blocks of the unit, and a block's hash is its last unit's."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as kcu

    monkeypatch.setenv("PYTHONHASHSEED", HASH_SEED)
    kcu.init_none_hash(sha256)
    size = unit or BLOCK
    parent = None
    out = []
    for b in range(len(tokens) // size):
        extra = (("cache_salt", salt),) if salt and b == 0 else None
        parent = kcu.hash_block_tokens(sha256, parent, tokens[b * size:(b + 1) * size], extra)
        if (b + 1) * size % BLOCK == 0:
            out.append(int.from_bytes(parent, "big") & MASK64)  # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES (its default)
    return out


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_next", "qwen3_next_unit"])
def test_hkvd_announces_what_it_holds_under_vllms_own_block_hashes(kind, tiny_lib, models_root, daemon_factory,
                                                                   monkeypatch) -> None:
    unit = UNIT if kind.endswith("_unit") else None
    kind = kind.removesuffix("_unit")
    model = tiny_lib.build(kind, models_root)
    node, node_replay = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    d = daemon_factory(BLOCK, "--kv-events-endpoint", node, "--kv-events-replay-endpoint", node_replay)
    t0 = time.monotonic()
    res = _run({"model": str(model), "socket": d.socket, "events": f"tcp://127.0.0.1:{_port()}",
                "replay": f"tcp://127.0.0.1:{_port()}", "prompts": [PROMPT, {"ids": SALTED, "salt": SALT}],
                "max_tokens": 100, "retention": BLOCK if kind == "qwen3_next" else None,
                "llm": {"prefix_match_unit": unit} if unit else {}})
    assert res["block_size"] == BLOCK
    engine_events = _events([bytes.fromhex(p) for _, p in res["batches"]])
    node_payloads = _replay(node_replay)
    node_events = _events(node_payloads)

    gpu = [e for e in engine_events if getattr(e, "medium", None) == "GPU"]
    connector = [e for e in engine_events if str(getattr(e, "medium", "")).startswith("HKVD_")]
    assert {e.medium for e in connector} == {"HKVD_POOL"}, "hkvd's events are missing from the engine's stream"
    # vLLM's own block table: hash -> (parent, tokens), from its full-attention group (it skips no block).
    kinds = {e.group_idx: (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in gpu
             if hasattr(e, "kv_cache_spec_kind")}
    full = next(g for g, (k, _) in kinds.items() if k == "full_attention")
    vllm_blocks = {h: (p, t) for g, h, p, t in _blocks(gpu) if g == full}
    by_group: dict[int, set[Any]] = {}
    for g, h, _, _ in _blocks(gpu):
        by_group.setdefault(g, set()).add(h)

    figures = {}
    for path, events in (("connector", connector), ("node", node_events)):
        blocks = _blocks(events)
        assert blocks, f"no BlockStored from the {path} path"
        same = sum(vllm_blocks.get(h) == (p, t) for _, h, p, t in blocks)
        figures[path] = (len(blocks), same)
        assert same == len(blocks), f"{path}: {len(blocks) - same} of {len(blocks)} blocks name another hash"
        for e in events:
            if hasattr(e, "kv_cache_spec_kind"):
                assert (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) == kinds[e.group_idx]
        held: dict[int, set[Any]] = {}
        for g, h, _, _ in blocks:
            held.setdefault(g, set()).add(h)
        for g, (k, _) in kinds.items():
            if k == "sliding_window":  # hkvd keeps the blocks vLLM drops out of the window
                assert by_group.get(g, set()) <= held[g], (path, g)
            else:  # full attention, Mamba/GDN: exactly the blocks vLLM caches
                assert held[g] == by_group[g], (path, g, k)
    assert {(g, h) for g, h, _, _ in _blocks(connector)} == {(g, h) for g, h, _, _ in _blocks(node_events)}
    # Partial entries (a unit below the block size): vLLM caches the prompt's state at its last multiple of
    # the unit inside a block (672 of 700 tokens) in every group, and announces one block of the unit there;
    # hkvd announces its partial chunk at that position the same way, in every group.
    # Sets: vLLM may announce the same partial entry twice (its full-attention group did here); hkvd once.
    partial = {(e.group_idx, h, e.parent_block_hash, tuple(e.token_ids), e.block_size) for e in node_events
               if isinstance(e, _stored_type()) and e.block_size < BLOCK for h in e.block_hashes}
    vllm_partial = {(e.group_idx, h, e.parent_block_hash, tuple(e.token_ids), e.block_size) for e in gpu
                    if isinstance(e, _stored_type()) and e.block_size < BLOCK for h in e.block_hashes}
    assert partial == vllm_partial, (sorted(p[0] for p in partial), sorted(p[0] for p in vllm_partial), kinds)
    assert bool(partial) == bool(unit), partial
    if unit:
        assert {t for *_, t in partial} == {unit} and {len(t) for _, _, _, t, _ in partial} == {unit}
        assert {g for g, *_ in partial} == set(kinds), "a group of the partial chunk was not announced"

    # The indexer's side: it recomputes the prompt's hashes and finds them; the salted prompt only with the salt.
    announced = {h for _, h, _, _ in _blocks(node_events)}
    plain = _indexer_hashes(PROMPT, None, monkeypatch, unit)
    salted = _indexer_hashes(SALTED, SALT, monkeypatch, unit)
    unsalted = _indexer_hashes(SALTED, None, monkeypatch, unit)
    assert set(plain) <= announced and set(salted) <= announced
    assert announced.isdisjoint(unsalted), "a salted prefix is announced under the hashes of its bare tokens"
    assert not any(SALT.encode() in p for p in node_payloads)
    assert not any(SALT in json.dumps(e.extra_keys) for e in connector if getattr(e, "extra_keys", None))
    # The check means something: vLLM's own event for the salted first block does carry the salt.
    assert any((SALT,) in (getattr(e, "extra_keys", None) or ()) for e in gpu)
    print(f"\n{kind} (prefix_match_unit {unit}): {len(partial)} partial blocks as vLLM's;"
          f" block hashes compared with vLLM's (blocks, equal): connector {figures['connector']}, "
          f"node {figures['node']}; indexer-recomputed: {len(plain)} plain + {len(salted)} salted found, "
          f"{len(unsalted)} bare-token hashes of the salted prompt absent; {time.monotonic() - t0:.0f} s")
