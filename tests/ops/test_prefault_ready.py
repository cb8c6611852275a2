"""Ready in seconds whatever the size: the daemon serves once a first slice of the pool is faulted,
stores land only in faulted superblocks, and systemd hears READY=1, then STATUS= progress.

The daemon runs in this process so a test hook can hold the pre-fault of everything past the
first slice (a gate on ``HugePagePool.populate``): what the test sees does not depend on timing.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from hkvd.daemon.app import Daemon
from hkvd.daemon.cache.pool import HugePagePool
from hkvd.daemon.cli import format_status
from hkvd.daemon.config import DaemonConfig
from hkvd.daemon.notify import Notifier
from hkvd.shim.testing.synthetic import GroupShape, SyntheticEngine, prompt_tokens
from hkvd.transport.keys import chunk_keys

MIB = 1 << 20
POOL = 64 * MIB  # 32 superblocks of 2 MiB; the first slice is 1/8 of it
FIRST = 8 * MIB
SHAPES = [GroupShape("full", 2, 256 * 1024)]  # 1 MiB a 32-token chunk


async def test_serves_after_the_first_slice_and_only_from_faulted_memory(tmp_path, monkeypatch, notify_socket):
    gate = threading.Event()
    real = HugePagePool.populate

    def gated(self: HugePagePool, start: int, n: int) -> None:
        if start >= FIRST:
            gate.wait(60)
        real(self, start, n)

    monkeypatch.setattr(HugePagePool, "populate", gated)
    cfg = DaemonConfig(socket_path=str(tmp_path / "hkvd.sock"), l1_size_bytes=POOL, hugepages="off",
                       chunk_size=32, prefault_threads=2, l2_path="")
    daemon = Daemon(cfg, notifier=Notifier({"NOTIFY_SOCKET": notify_socket.path}))
    before_ready: list[dict[str, str]] = []

    async def scenario() -> None:
        try:
            ready = await asyncio.to_thread(notify_socket.wait_for, "READY", 60, before_ready.append)
            assert daemon.pool is not None and daemon.service is not None
            assert any("EXTEND_TIMEOUT_USEC" in m for m in before_ready), before_ready
            assert "8 / 64 MiB pre-faulted (12%)" in ready["STATUS"], ready
            status = daemon.service.status()
            assert status["pool"]["faulted_bytes"] == FIRST and not status["pool"]["prefault"]["done"]
            assert "12% faulted (pre-faulting on 2 threads)" in format_status(status)

            # 20 chunks into 8 faulted MiB: the store drops or evicts rather than touch unfaulted memory.
            eng = await asyncio.to_thread(SyntheticEngine, cfg.socket_path, SHAPES, num_blocks=64)
            keys = chunk_keys(prompt_tokens(32 * 20, seed=1), 32)
            items = eng.items(0, keys, first_block=1)
            eng.fill_random(0, [b for it in items for b in it.block_ids], seed=3)
            await asyncio.to_thread(eng.store, items)
            stored = daemon.service.index.keys()  # the cache's read-only view
            entries = [daemon.service.index.get(k) for k in stored]
            assert 0 < len(entries) <= 8
            for e in entries:
                assert e is not None
                assert all(x.pool_offset + e.alloc.slot_bytes <= FIRST for x in e.alloc.extents), e.alloc
            idx = daemon.service.status()["index"]
            assert idx["evictions"] + idx["stores_dropped"] == 20 - len(entries) > 0, idx

            # While serving, STATUS= reports the faulted share (every second).
            progress = await asyncio.to_thread(notify_socket.wait_for, "STATUS", 30)
            assert "serving 1 engines" in progress["STATUS"] and "8 / 64 MiB pre-faulted" in progress["STATUS"]
            gate.set()  # the rest of the pool faults in
            while "pool pre-faulted" not in (await asyncio.to_thread(notify_socket.wait_for, "STATUS", 30))["STATUS"]:
                pass
            status = daemon.service.status()
            assert status["pool"]["faulted_bytes"] == POOL and status["pool"]["prefault"]["done"]
            assert status["pool"]["prefault"]["error"] == "" and "100% faulted (pre-faulted)" in format_status(status)
            await asyncio.to_thread(eng.store, items)  # now the whole prompt fits
            assert len(daemon.service.index) == 20
            await asyncio.to_thread(eng.close)
        finally:
            gate.set()
            daemon.request_stop()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(daemon.serve())
        tg.create_task(scenario())


async def test_a_populate_error_in_the_first_slice_fails_the_start(tmp_path, monkeypatch):
    def failing(self: HugePagePool, start: int, n: int) -> None:
        from hkvd.transport.errors import PoolError

        raise PoolError(f"pre-faulting the plain pool failed at byte {start}: no memory")

    monkeypatch.setattr(HugePagePool, "populate", failing)
    cfg = DaemonConfig(socket_path=str(tmp_path / "hkvd.sock"), l1_size_bytes=POOL, hugepages="off", chunk_size=32)
    daemon: Any = Daemon(cfg, notifier=Notifier({}))
    with pytest.raises(Exception, match="pre-faulting the plain pool failed at byte 0"):
        await daemon.serve()
    assert not daemon.ready.is_set()
