"""A router's usable-prefix answer and an engine's lookup agree: both are what ``Cache.plan_lookup`` plans.

The daemon's own service, cache and disk tier (in a temporary directory), with this process as a hybrid
engine (full attention and a Mamba group): two partial chunks inside chunk 2 are stored, the longer one is
then dropped from the pool and kept on disk. The router's answer counts the longer one (the pool and the disk
together); so must the engine's lookup that offers both as tails, longest first: it reads the longer one from
disk rather than taking the shorter one the pool holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.engines.in_process import disk_tier, in_process_service, own_conn
from hkvd.daemon.http import Request, Response
from hkvd.daemon.metrics import Metrics
from hkvd.daemon.routing.usable_prefix import UsablePrefix
from hkvd.daemon.tiers.disk import DiskTier
from hkvd.transport.copy_engine import Region
from hkvd.transport.keys import chunk_keys, partial_key
from hkvd.transport.layout import GroupSpec, View
from hkvd.transport.wire import Message, control, events, kv
from hkvd.transport.wire.control import EngineSpec

PAGE = 4096
BLOCKS = 32
CHUNK = 32  # tokens: two blocks of 16
TOKENS = list(range(1000, 1000 + 2 * CHUNK + 30))  # two whole chunks and 30 tokens: a fresh engine computes one
KEYS = chunk_keys(TOKENS, CHUNK)
SHORT, LONG = 2 * CHUNK + 1, 2 * CHUNK + 20  # where the two partial chunks inside chunk 2 end


def _partial(end: int) -> bytes:
    return partial_key(KEYS[1], TOKENS[2 * CHUNK:end])


class Node:
    """The service over a 64 MiB pool and a disk tier, and this process as its engine."""

    def __init__(self, root: Path) -> None:
        cfg = DaemonConfig(chunk_size=CHUNK, l1_size_bytes=64 << 20, hugepages="off")
        self._parts = contextlib.ExitStack()
        parts = self._parts.enter_context(in_process_service(cfg, threads=2, tiers=disk_tier(str(root), self._keep)))
        self.pool, self.cache, self.service = parts.pool, parts.cache, parts.service
        self.sent: list[Message] = []
        self.conn = own_conn(self.sent)
        self.mem = np.zeros(2 * BLOCKS * PAGE, dtype=np.uint8)

    def _keep(self, disk: DiskTier) -> None:
        self.disk = disk

    def close(self) -> None:
        self.service.disconnect(self.conn)
        self.disk.close(5.0)
        self._parts.close()

    async def call(self, msg: Message) -> Message:
        before = len(self.sent)
        job = self.service.handle(self.conn, msg)
        if job is not None:
            await job
        [reply] = self.sent[before:]
        return reply

    async def register(self) -> None:
        groups = [GroupSpec(g, kind, 16, 0, BLOCKS, "bfloat16", (View(0, g * BLOCKS * PAGE, 1, PAGE, PAGE, PAGE),))
                  for g, kind in enumerate(("full", "mamba"))]
        spec = EngineSpec("m", 1, 0, "t", CHUNK, 16, 8192, "align",
                          [Region(0, "host", self.mem.nbytes, addr=self.mem.ctypes.data)], groups)
        assert isinstance(await self.call(control.Register(1, spec.to_wire())), control.RegisterAck)


@pytest.fixture
async def node(tmp_path: Path) -> AsyncIterator[Node]:
    n = Node(tmp_path / "l2")
    try:
        yield n
    finally:
        n.close()


async def _store(node: Node) -> None:
    """Chunks 0 and 1 (attention, and the state after chunk 1) and both partial chunks of chunk 2, confirmed."""
    short, long = _partial(SHORT), _partial(LONG)
    await node.call(kv.Store(2, [kv.Item(0, 0, KEYS[0], [1, 2]), kv.Item(0, 1, KEYS[1], [3, 4], KEYS[0]),
                                 kv.Item(0, 2, short, [5, 6], KEYS[1]), kv.Item(0, 2, long, [7, 8], KEYS[1])]))
    states = [kv.Item(1, 1, KEYS[1], [9], KEYS[0]), kv.Item(1, 2, short, [10], KEYS[1]),
              kv.Item(1, 2, long, [11], KEYS[1])]
    await node.call(events.StepEvent(3, 0, 1, states, []))
    await node.call(events.StepEvent(4, 1, 2, [], [3]))  # the states confirmed
    fp = node.conn.engine.fingerprint  # type: ignore[union-attr]
    on_disk = [(fp, 0, KEYS[0]), *((fp, g, k) for g in (0, 1) for k in (KEYS[1], short, long))]
    for _ in range(2000):  # the write-behind's thread: 20 s at most
        if all(node.disk.get(k) is not None for k in on_disk):
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the disk tier did not write the entries within 20 s")


def _usable(node: Node) -> int:
    up = UsablePrefix(node.service, Metrics())
    up.book.add(node.conn.engine)  # type: ignore[arg-type]
    got = up.post(Request("POST", "/v1/usable_prefix", "", {"content-type": "application/json"},
                          json.dumps({"model": "m", "token_ids": TOKENS}).encode()))
    assert isinstance(got, Response) and got.status == 200, got
    return int(json.loads(got.body)["usable_tokens"])


async def test_a_usable_prefix_answer_equals_the_engines_hit_with_a_longer_tail_on_disk(node: Node) -> None:
    await node.register()
    await _store(node)
    fp = node.conn.engine.fingerprint  # type: ignore[union-attr]
    for g in (0, 1):  # the longer partial chunk leaves the pool; the disk keeps it
        entry = node.cache.get((fp, g, _partial(LONG)))
        assert entry is not None
        node.cache.drop(entry)
    assert _usable(node) == LONG  # the pool and the disk together

    tails = [[2, _partial(LONG)], [2, _partial(SHORT)]]  # longest first, as the shim sends them
    reply = await node.call(kv.Lookup(5, KEYS[:2], False, tails))
    assert isinstance(reply, kv.LookupReply) and (reply.hit_chunks, reply.tail) == (3, 1), reply
    assert (LONG, SHORT)[reply.tail - 1] == _usable(node)  # read into the pool: the same answer from it now
    assert node.cache.is_ready((fp, 1, _partial(LONG)))
