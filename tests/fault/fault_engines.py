"""Engine processes for the fault suite: each role is one real engine process against a real daemon.

Role
    The fault tests start these with ``python tests/fault/fault_engines.py ROLE --socket S ...``
    and kill, stop or wait for them. Every role registers host KV memory through
    ``hkvd.shim.testing.synthetic.SyntheticEngine`` and talks to the daemon only through the client, as
    the shim does. Block contents are derived from a tag (role, prefix, block, layer), so any
    process can tell whether bytes that came back are exactly the bytes that were stored.

    - ``bystander``: store / lookup / retrieve / verify small prefixes in a loop (the engine that
      must not notice a neighbour's crash).
    - ``store-stream``: store new 8 MiB prefixes back to back, until killed.
    - ``retrieve-loop``: store one 16 MiB prefix, then lookup + retrieve it back to back, until killed.
    - ``holder``: a hybrid engine (full attention + 3 Mamba groups) that leases prefixes and holds
      the leases through a storm, then retrieves and verifies them; also stores never-touched
      "cold" prefixes and finally one store larger than the room left (pool full, counted drops).
    - ``hot``: a hybrid engine that loops lookup + retrieve + verify of one prefix (pinned copies).
    - ``storm``: a hybrid engine that stores large prefixes (attention + Mamba states through step
      events) over and over, far over the pool's capacity.
    - ``reader``: lookups without a lease, then retrieves storm prefixes and verifies them; a miss
      between the two is a typed NOT_FOUND.
    - ``soak``: a mix of everything (stores, step events with confirms, leased and lease-less
      lookups, retrieves with verification, leases left to expire, aborted stores).
    - ``churn``: connect, register, store, lookup, disconnect without releasing, over and over.
    - ``crowd``: ``--engines`` connections from this one process, each registering an engine (one small
      shared buffer), held until ``--stop-file`` appears; counts registrations, refusals by error code,
      and connections the daemon closed without a word.

Output
    One JSON line ``{"ready": true, ...}`` once the role's set-up is done (flushed), and one final
    JSON line ``{"result": {...}}`` when a bounded role ends (``--seconds`` or ``--stop-file``).
    ``result`` counts operations, misses, typed errors by code (``errors``), bytes that came back
    wrong (``wrong``: must be 0), and pool-full drops the daemon reported (``dropped``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hkvd.shim.client import DaemonClient
from hkvd.shim.ptrace import allow_ptracer
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.copy_engine import Region
from hkvd.transport.errors import DaemonUnavailable, KVError
from hkvd.transport.keys import chunk_keys
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire.control import EngineSpec
from hkvd.transport.wire.kv import Item

KIB = 1 << 10
SMALL = [GroupShape("full", 2, 16 * KIB)]  # 64 KiB entries at chunk 32
BIG = [GroupShape("full", 2, 256 * KIB)]  # 1 MiB entries at chunk 32
# Hybrid: one aliased buffer, pages padded to the attention page (vLLM's layout). Chunk = block = 16.
HYB = [GroupShape("full", 2, 256 * KIB)] + [GroupShape("mamba", 2, 96 * KIB, 256 * KIB)] * 3
HYB_SOAK = [GroupShape("full", 2, 32 * KIB)] + [GroupShape("mamba", 2, 12 * KIB, 32 * KIB)] * 3
HYB_KW = {"tokens_per_block": 16, "chunk_size": 16, "aliased": True}
MAMBA = (1, 2, 3)


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Tagged:
    """A ``SyntheticEngine`` whose blocks hold bytes derived from tags, so they can be verified."""

    def __init__(self, socket_path: str, shapes: Sequence[GroupShape], **kw: object) -> None:
        self.eng = SyntheticEngine(socket_path, shapes, timeout_s=60.0, **kw)  # type: ignore[arg-type]
        self.client = self.eng.client
        self.errors: dict[str, int] = {}
        self.wrong = 0
        self.wrong_detail: list[str] = []
        self.dropped = 0

    @staticmethod
    def pattern(tag: object, nbytes: int) -> np.ndarray:
        digest = hashlib.blake2b(repr(tag).encode(), digest_size=64).digest()
        return np.resize(np.frombuffer(digest, dtype=np.int8), nbytes)

    def put(self, group: int, block: int, tag: object) -> None:
        for layer in range(self.eng.groups[group].views[0].num_layers):
            page = self.eng.page(group, layer, block)
            page[:] = self.pattern((tag, layer), page.size)

    def check(self, group: int, block: int, tag: object) -> bool:
        for layer in range(self.eng.groups[group].views[0].num_layers):
            page = self.eng.page(group, layer, block)
            if not np.array_equal(page, self.pattern((tag, layer), page.size)):
                return False
        return True

    def error(self, e: KVError) -> None:
        name = e.code.name
        self.errors[name] = self.errors.get(name, 0) + 1

    def run(self, req_id: int) -> Any:
        c = self.client.wait([req_id], 60.0)[req_id]
        if c.error is not None:
            raise c.error
        self.dropped += getattr(c.result, "dropped", 0)  # stores and step events say how many found no room
        return c.result

    def result(self, **extra: object) -> dict:
        return {"errors": self.errors, "wrong": self.wrong, "dropped": self.dropped, **extra,
                **({"wrong_detail": self.wrong_detail} if self.wrong_detail else {})}


class Steps:
    """Step events the way the shim sends them: offers now, confirms only of copies seen done."""

    def __init__(self, t: Tagged) -> None:
        self.t = t
        self.seq = 0
        self.last: int | None = None

    def settle(self) -> list[int]:
        """Wait for the previous event's copies (before its blocks may be reused); return confirms."""
        if self.last is None:
            return []
        last, self.last = self.last, None
        c = self.t.client.wait([last], 60.0)[last]
        if c.error is not None:
            self.t.error(c.error)
            return []
        self.t.dropped += int(c.result.dropped)
        return [last]

    def event(self, offers: list[Item], confirms: list[int]) -> None:
        self.seq += 1
        self.last = self.t.client.submit_step_event(self.seq, self.seq, offers, confirms)

    def finish(self) -> None:
        self.event([], self.settle())
        self.settle()


def stopped(a: argparse.Namespace, t0: float) -> bool:
    if a.stop_file and os.path.exists(a.stop_file):
        return True
    return bool(a.seconds) and time.monotonic() - t0 >= a.seconds


# ---------------------------------------------------------------------------------------- kill tests


def bystander(a: argparse.Namespace) -> None:
    t = Tagged(a.socket, SMALL, num_blocks=16, model="bystander")
    C, bpc = t.eng.chunk_size, t.eng.blocks_per_chunk()
    ops = misses = 0
    i = 0
    t0 = time.monotonic()
    while not stopped(a, t0):
        seed = i % 16
        keys = chunk_keys(prompt_tokens(2 * C, seed=5000 + seed), C)
        src = t.eng.items(0, keys, first_block=1)
        for it in src:
            for b in it.block_ids:
                t.put(0, b, ("by", seed, b))
        try:
            t.run(t.client.submit_store(src))
            hit, lease = (lambda r: (r.hit_chunks, r.lease_id))(t.run(t.client.submit_lookup(keys)))
            if hit == len(keys):
                dst = t.eng.items(0, keys, first_block=1 + 2 * bpc)
                t.eng.zero(0, [b for it in dst for b in it.block_ids])
                t.run(t.client.submit_retrieve(dst, lease))
                for it, s in zip(dst, src, strict=True):
                    for b, sb in zip(it.block_ids, s.block_ids, strict=True):
                        t.wrong += not t.check(0, b, ("by", seed, sb))
            else:
                misses += 1
                if lease:
                    t.client.release(lease)
            ops += 1
        except KVError as e:
            t.error(e)
        i += 1
        if i == 16:
            emit({"ready": True, "warm": True})
    emit({"result": t.result(ops=ops, misses=misses)})
    t.eng.close()


def store_stream(a: argparse.Namespace) -> None:
    t = Tagged(a.socket, BIG, num_blocks=1 + 8 * 2, model="stream")
    C = t.eng.chunk_size
    first = t.eng.items(0, chunk_keys(prompt_tokens(8 * C, seed=0), C), first_block=1)
    for it in first:
        for b in it.block_ids:
            t.put(0, b, ("ss", b))
    progress = os.open(a.progress, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    outstanding: dict[int, int] = {}
    seed = 0
    announced = False
    while True:
        while len(outstanding) < 2:
            keys = chunk_keys(prompt_tokens(8 * C, seed=seed), C)
            outstanding[t.client.submit_store(t.eng.items(0, keys, first_block=1))] = seed
            seed += 1
        for c in t.client.poll(1.0):
            s = outstanding.pop(c.req_id, None)
            if s is not None and c.ok:
                os.pwrite(progress, f"{s:<12}".encode(), 0)
                if not announced:
                    emit({"ready": True})
                    announced = True


def retrieve_loop(a: argparse.Namespace) -> None:
    t = Tagged(a.socket, BIG, num_blocks=1 + 2 * 16 * 2, model="reloop")
    C, bpc = t.eng.chunk_size, t.eng.blocks_per_chunk()
    keys = chunk_keys(prompt_tokens(16 * C, seed=1), C)
    src = t.eng.items(0, keys, first_block=1)
    for it in src:
        for b in it.block_ids:
            t.put(0, b, ("rl", b))
    t.run(t.client.submit_store(src))
    dst = t.eng.items(0, keys, first_block=1 + 16 * bpc)
    announced = False
    while True:
        r = t.run(t.client.submit_lookup(keys))
        t.run(t.client.submit_retrieve(dst, r.lease_id))
        if not announced:
            emit({"ready": True, "entries": len(keys)})
            announced = True


def check_stream(a: argparse.Namespace) -> None:
    """Look up every prefix store-stream may have stored; whatever a lookup serves must be byte-exact."""
    t = Tagged(a.socket, BIG, num_blocks=1 + 8 * 2, model="stream")
    C = t.eng.chunk_size
    prefixes = entries = 0
    for seed in range(max(0, a.last - a.window), a.last + 4):
        keys = chunk_keys(prompt_tokens(8 * C, seed=seed), C)
        r = t.run(t.client.submit_lookup(keys))
        hit = r.hit_chunks
        if not hit:
            continue
        items = t.eng.items(0, keys, first_block=1)[:hit]
        blocks = [b for it in items for b in it.block_ids]
        t.eng.zero(0, blocks)
        t.run(t.client.submit_retrieve(items, r.lease_id))
        t.wrong += sum(not t.check(0, b, ("ss", b)) for b in blocks)
        prefixes += 1
        entries += hit
    emit({"result": t.result(prefixes_hit=prefixes, entries_checked=entries)})
    t.eng.close()


# ---------------------------------------------------------------------------------------- pressure


def _hyb_prefix(t: Tagged, steps: Steps, tag: object, keys: list[bytes], *, every_chunk_mamba: bool,
                base: int = 1) -> None:
    """Store one prefix: attention chunk i on block base+i; Mamba group g's state after chunk i on
    block base+K+3*i+(g-1) (every chunk, or only the last)."""
    K = len(keys)
    confirms = steps.settle()  # the previous event's copies are done: its blocks may be rewritten
    attn = [Item(0, i, keys[i], [base + i]) for i in range(K)]
    for it in attn:
        t.put(0, it.block_ids[0], (tag, it.block_ids[0]))
    offers = []
    for i in range(K) if every_chunk_mamba else [K - 1]:
        for g in MAMBA:
            blk = base + K + 3 * i + (g - 1)
            t.put(g, blk, (tag, blk))
            offers.append(Item(g, i, keys[i], [blk]))
    try:
        t.run(t.client.submit_store(attn))
    except KVError as e:
        t.error(e)
    steps.event(offers, confirms)


def _hyb_items(keys: list[bytes], hit: int, base: int = 1) -> list[Item]:
    K = len(keys)
    items = [Item(0, i, keys[i], [base + i]) for i in range(hit)]
    items += [Item(g, hit - 1, keys[hit - 1], [base + K + 3 * (hit - 1) + (g - 1)]) for g in MAMBA]
    return items


def _verify(t: Tagged, items: list[Item], tag: object, src_base: int, dst_base: int) -> None:
    for it in items:
        b = it.block_ids[0]
        if not t.check(it.group_id, b, (tag, b - dst_base + src_base)):
            t.wrong += 1
            if len(t.wrong_detail) < 5:
                t.wrong_detail.append(f"{tag} group {it.group_id} chunk {it.chunk_index} block {b}")


def holder(a: argparse.Namespace) -> None:
    K = 4
    t = Tagged(a.socket, HYB, num_blocks=1 + 2 * (K + 3 * K), **HYB_KW)  # type: ignore[arg-type]
    steps = Steps(t)
    held = [chunk_keys(prompt_tokens(16 * K, seed=10_000 + p), 16) for p in range(a.prefixes)]
    cold = [chunk_keys(prompt_tokens(16 * K, seed=20_000 + p), 16) for p in range(a.cold)]
    for p, keys in enumerate(cold):
        _hyb_prefix(t, steps, ("cold", p), keys, every_chunk_mamba=False)
    for p, keys in enumerate(held):
        _hyb_prefix(t, steps, ("held", p), keys, every_chunk_mamba=False)
    steps.finish()
    leases = []
    for keys in held:
        r = t.run(t.client.submit_lookup(keys))
        assert r.hit_chunks == K, f"held prefix not fully stored before the storm: {r}"
        leases.append(r.lease_id)
    emit({"ready": True})
    while not os.path.exists(a.stop_file):
        time.sleep(0.05)
    cold_hits = sum(t.run(t.client.submit_lookup(keys, False)).hit_chunks for keys in cold)
    # One store larger than the room the leases leave: the pool is full of leased entries, so some
    # items are dropped (counted by the daemon), and nothing else fails.
    over = chunk_keys(prompt_tokens(16 * a.overflow_chunks, seed=30_000), 16)
    dropped_before = t.dropped
    t.run(t.client.submit_store([Item(0, i, k, [1 + i % K]) for i, k in enumerate(over)]))
    overflow_dropped = t.dropped - dropped_before
    # After the storm and the overflow: every leased entry is still there, byte for byte.
    dst = 1 + K + 3 * K
    for p, (keys, lease) in enumerate(zip(held, leases, strict=True)):
        items = _hyb_items(keys, K, base=dst)
        for it in items:
            t.eng.zero(it.group_id, it.block_ids)
        try:
            t.run(t.client.submit_retrieve(items, lease))
            _verify(t, items, ("held", p), 1, dst)
        except KVError as e:
            t.error(e)
            t.wrong += len(items)  # a leased entry that is gone is lost bytes
    emit({"result": t.result(leased_prefixes=len(held), cold_hits=cold_hits,
                             overflow_dropped=overflow_dropped)})
    t.eng.close()


def hot(a: argparse.Namespace) -> None:
    K = 4
    t = Tagged(a.socket, HYB, num_blocks=1 + 2 * (K + 3 * K), **HYB_KW)  # type: ignore[arg-type]
    steps = Steps(t)
    keys = chunk_keys(prompt_tokens(16 * K, seed=40_000), 16)
    _hyb_prefix(t, steps, "hot", keys, every_chunk_mamba=False)
    steps.finish()
    dst = 1 + K + 3 * K
    items = _hyb_items(keys, K, base=dst)
    ops = misses = 0
    emit({"ready": True})
    while not os.path.exists(a.stop_file):
        try:
            r = t.run(t.client.submit_lookup(keys))
            if r.hit_chunks != K:  # evicted while not leased (LRU under the storm): store it again
                misses += 1
                if r.lease_id:
                    t.client.release(r.lease_id)
                _hyb_prefix(t, steps, "hot", keys, every_chunk_mamba=False)
                steps.finish()
                continue
            for it in items:
                t.eng.zero(it.group_id, it.block_ids)
            t.run(t.client.submit_retrieve(items, r.lease_id))  # leased: must never fail
            _verify(t, items, "hot", 1, dst)
            ops += 1
        except KVError as e:
            t.error(e)
    emit({"result": t.result(ops=ops, misses=misses)})
    t.eng.close()


STORM_K = 16
STORM_PREFIXES = 6


def storm(a: argparse.Namespace) -> None:
    K = STORM_K
    t = Tagged(a.socket, HYB, num_blocks=1 + K + 3 * K, **HYB_KW)  # type: ignore[arg-type]
    steps = Steps(t)
    prefixes = 0
    progress = os.open(a.progress, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    emit({"ready": True})
    while not os.path.exists(a.stop_file):
        j = prefixes % STORM_PREFIXES
        keys = chunk_keys(prompt_tokens(16 * K, seed=50_000 + 100 * a.id + j), 16)
        _hyb_prefix(t, steps, ("storm", a.id, j), keys, every_chunk_mamba=True)
        os.pwrite(progress, f"{(prefixes - 1) % STORM_PREFIXES:<4}".encode(), 0)  # its states are confirmed
        prefixes += 1
    steps.finish()
    emit({"result": t.result(prefixes=prefixes, bytes_offered=prefixes * K * (512 + 3 * 192) * KIB)})
    t.eng.close()


def reader(a: argparse.Namespace) -> None:
    K = STORM_K
    t = Tagged(a.socket, HYB, num_blocks=1 + K + 3 * K, **HYB_KW)  # type: ignore[arg-type]
    rng = random.Random(a.id)
    ops = hits = 0
    emit({"ready": True})
    while not os.path.exists(a.stop_file):
        # Mostly the prefix a storm engine finished last (likely still cached), sometimes any.
        sid, j = rng.randrange(a.storms), rng.randrange(STORM_PREFIXES)
        latest = Path(a.progress).with_name(f"storm-{sid}")
        if rng.random() < 0.8 and latest.exists() and latest.read_text().strip():
            j = int(latest.read_text())
        keys = chunk_keys(prompt_tokens(16 * K, seed=50_000 + 100 * sid + j), 16)
        try:
            hit = t.run(t.client.submit_lookup(keys, False)).hit_chunks
            ops += 1
            if not hit:
                time.sleep(0.005)
                continue
            items = _hyb_items(keys, hit)
            for it in items:
                t.eng.zero(it.group_id, it.block_ids)
            t.run(t.client.submit_retrieve(items))  # no lease: may be evicted in between
            _verify(t, items, ("storm", sid, j), 1, 1)
            hits += 1
        except KVError as e:
            t.error(e)
    emit({"result": t.result(ops=ops, hits=hits)})
    t.eng.close()


# ---------------------------------------------------------------------------------------- soak


def soak(a: argparse.Namespace) -> None:
    K = 4
    base_dst = 1 + K + 3 * K
    t = Tagged(a.socket, HYB_SOAK, num_blocks=1 + 2 * (K + 3 * K), **HYB_KW)  # type: ignore[arg-type]
    steps = Steps(t)
    rng = random.Random(a.id)
    ops = {"stored": 0, "retrieved": 0, "misses": 0, "abandoned_leases": 0, "aborted": 0, "released": 0}
    emit({"ready": True})
    t0 = time.monotonic()
    while not stopped(a, t0):
        p = rng.randrange(a.window)
        keys = chunk_keys(prompt_tokens(16 * K, seed=60_000 + p), 16)
        r = rng.random()
        try:
            if r < 0.05:  # a store the engine gives up on at once (it may still complete: right bytes)
                t.put(0, 1, (("soak", p), 1))
                rid = t.client.submit_store([Item(0, 0, keys[0], [1])])
                t.client.abort(rid)
                c = t.client.wait([rid], 60.0)[rid]
                if c.error is not None and c.error.code.name != "ABORTED":
                    t.error(c.error)
                ops["aborted"] += 1
                continue
            res = t.run(t.client.submit_lookup(keys, r >= 0.15))
            hit, lease = res.hit_chunks, res.lease_id
            if r < 0.25 and lease:  # leased and never used: the daemon expires it (--lease-ttl-s)
                ops["abandoned_leases"] += 1
                continue
            if hit < K:
                if lease:
                    t.client.release(lease)
                    ops["released"] += 1
                _hyb_prefix(t, steps, ("soak", p), keys, every_chunk_mamba=True)
                ops["stored"] += 1
                ops["misses"] += 1
                continue
            items = _hyb_items(keys, hit, base=base_dst)
            for it in items:
                t.eng.zero(it.group_id, it.block_ids)
            t.run(t.client.submit_retrieve(items, lease))
            _verify(t, items, ("soak", p), 1, base_dst)
            ops["retrieved"] += 1
        except KVError as e:
            t.error(e)
    steps.finish()
    emit({"result": t.result(**ops)})
    t.eng.close()


def churn(a: argparse.Namespace) -> None:
    cycles = 0
    errors: dict[str, int] = {}
    wrong = 0
    emit({"ready": True})
    t0 = time.monotonic()
    while not stopped(a, t0):
        t = Tagged(a.socket, SMALL, num_blocks=8, model="churn")
        C = t.eng.chunk_size
        keys = chunk_keys(prompt_tokens(2 * C, seed=70_000 + cycles % 50), C)
        items = t.eng.items(0, keys, first_block=1)
        for it in items:
            for b in it.block_ids:
                t.put(0, b, ("churn", cycles % 50, b))
        try:
            t.run(t.client.submit_store(items))
            t.run(t.client.submit_lookup(keys))  # the lease is left for the disconnect to release
        except KVError as e:
            t.error(e)
        for k, v in t.errors.items():
            errors[k] = errors.get(k, 0) + v
        wrong += t.wrong
        t.eng.close()
        cycles += 1
    emit({"result": {"cycles": cycles, "errors": errors, "wrong": wrong, "dropped": 0}})


def crowd(a: argparse.Namespace) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = a.engines + 256  # this process's own descriptors besides the connections
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    # One small buffer serves every engine's one group (16 KiB pages, 4 blocks).
    buf = np.zeros(4 * 16 * KIB, dtype=np.int8)
    view = View(0, 0, 1, 4 * 16 * KIB, 16 * KIB, 16 * KIB)
    spec = EngineSpec("crowd", 1, 0, "host/LBHNC", 32, 16, 8192, "align",
                      [Region(0, "host", buf.nbytes, addr=buf.ctypes.data)],
                      [GroupSpec(0, "full", 16, 0, 4, "bfloat16", (view,))])
    held: list[DaemonClient] = []
    refused: dict[str, int] = {}
    messages: dict[str, str] = {}
    dropped = 0
    for _ in range(a.engines):
        c = DaemonClient(a.socket, client_name=f"crowd-{os.getpid()}", role="worker", timeout_s=60.0)
        try:
            c.connect()
            if not held:
                allow_ptracer(c.daemon_pid)
            c.register(spec)
            held.append(c)
        except DaemonUnavailable:
            dropped += 1  # closed without a word: never expected
            c.close()
        except KVError as e:
            refused[e.code.name] = refused.get(e.code.name, 0) + 1
            messages.setdefault(e.code.name, e.message)
            c.close()
    emit({"ready": True, "registered": len(held), "refused": refused, "messages": messages, "dropped": dropped})
    t0 = time.monotonic()
    while not stopped(a, t0):
        time.sleep(0.05)
    alive = sum(c.ping() is not None for c in held)
    for c in held:
        c.close()
    emit({"result": {"registered": len(held), "alive": alive, "errors": refused, "wrong": 0, "dropped": dropped}})


ROLES = {"bystander": bystander, "store-stream": store_stream, "retrieve-loop": retrieve_loop,
         "check-stream": check_stream, "holder": holder, "hot": hot, "storm": storm, "reader": reader,
         "soak": soak, "churn": churn, "crowd": crowd}


def main() -> None:
    p = argparse.ArgumentParser(prog="fault_engines.py")
    p.add_argument("role", choices=sorted(ROLES))
    p.add_argument("--socket", required=True)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--stop-file", default="")
    p.add_argument("--progress", default=str(Path(os.environ.get("TMPDIR", "/tmp"), "hkvd-stream-progress")))
    p.add_argument("--id", type=int, default=0)
    p.add_argument("--last", type=int, default=0)
    p.add_argument("--window", type=int, default=40)
    p.add_argument("--prefixes", type=int, default=16)
    p.add_argument("--cold", type=int, default=4)
    p.add_argument("--overflow-chunks", type=int, default=64)
    p.add_argument("--storms", type=int, default=3)
    p.add_argument("--engines", type=int, default=1000)
    a = p.parse_args()
    ROLES[a.role](a)


if __name__ == "__main__":
    main()
