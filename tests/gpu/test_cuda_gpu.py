"""GPU tests of the CUDA path (marker ``gpu``; ``make test-gpu`` on a CUDA node).

They skip with a reason where CuPy or a device is missing, and FAIL instead when
``HKVD_REQUIRE_GPU=1`` (as ``make test-gpu`` sets), so a GPU CI job cannot pass by skipping.
An engine process (``_engine_child.serve``, spawned) owns and exports the CUDA buffer; this
process plays the daemon: it opens the IPC handles and copies to and from a pinned pool.
"""

from __future__ import annotations

import ctypes
import mmap
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hkvd.cuda._cupy import cupy_available, device_count
from hkvd.transport.copy_engine import Direction, Region, Segment
from hkvd.transport.errors import CopyFailedError, KVTimeout, PagesInUse

pytestmark = pytest.mark.gpu

HERE = Path(__file__).resolve().parent
NO_GPU = "no CUDA device: run make test-gpu on a GPU node"


@pytest.fixture(autouse=True, scope="module")
def _require_gpu() -> None:
    reason = None
    if not cupy_available():
        reason = f"cupy is not installed ({NO_GPU}, with pip install -e '.[gpu]')"
    elif device_count() == 0:
        reason = NO_GPU
    if reason is None:
        return
    if os.environ.get("HKVD_REQUIRE_GPU") == "1":
        pytest.fail(f"HKVD_REQUIRE_GPU=1 but {reason}")
    pytest.skip(reason)


class MmapPool:
    """A page-aligned anonymous mapping with ``base_addr`` / ``size`` (what the engine needs)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._mm = mmap.mmap(-1, size)
        self._anchor: Any = ctypes.c_char.from_buffer(self._mm)
        self.base_addr = ctypes.addressof(self._anchor)
        self.array = np.frombuffer(self._mm, dtype=np.uint8)

    def close(self) -> None:
        del self.array
        self._anchor = None
        self._mm.close()


class Engine:
    """Client of the spawned engine process."""

    def __init__(self) -> None:
        sys.path.insert(0, str(HERE))  # spawn children inherit sys.path: they import _engine_child
        try:
            import _engine_child

            self.mod = _engine_child
            ctx = mp.get_context("spawn")
            self.conn, child = ctx.Pipe()
            self.proc = ctx.Process(target=_engine_child.serve, args=(child,), daemon=True)
            self.proc.start()
        finally:
            sys.path.remove(str(HERE))
        self.nbytes = 0

    def call(self, *cmd: Any, timeout_s: float = 60.0) -> tuple[Any, ...]:
        self.conn.send(cmd)
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"engine child did not answer {cmd[0]!r} in {timeout_s} s")
        reply = self.conn.recv()
        if reply[0] != "ok":
            raise RuntimeError(f"engine child: {reply[1]}")
        return tuple(reply[1:])

    def alloc(self, nbytes: int, seed: int, region_ids: tuple[int, ...] = (1,)) -> list[Region]:
        self.nbytes = nbytes
        rows, self.backend = self.call("alloc", nbytes, seed, list(region_ids))
        return [
            Region(rid, "cuda", size, handle=h, device_uuid=u, offset=off) for rid, size, h, u, off in rows
        ]

    def read(self) -> np.ndarray:
        return np.frombuffer(self.call("read")[0], dtype=np.uint8)

    def close(self) -> None:
        try:
            self.call("exit", timeout_s=10)
        finally:
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.close()


@pytest.fixture
def pool() -> Iterator[MmapPool]:
    p = MmapPool(32 << 20)
    yield p
    p.close()


def _layout(case: str, nbytes: int) -> tuple[Any, list[int]]:
    layout = pytest.importorskip("hkvd.transport.layout")
    nb, nl = 16, 4
    if case == "kv_split":  # per layer [2, num_blocks, page]: K and V strided views
        page = 64 << 10
        views = (layout.View(1, 0, nl, 2 * nb * page, page, page),
                 layout.View(1, nb * page, nl, 2 * nb * page, page, page))
    else:  # padded, unaligned pages: the kernel's byte path
        page = 5000
        views = (layout.View(1, 8, nl, 5008, 5008 * nl, page),)
    group = layout.GroupSpec(0, "full", 16, 0, nb, "bfloat16", views)
    group.validate({1: nbytes})
    return group, [5, 1, 9]


def _segments(group: Any, block_ids: list[int]) -> list[Segment]:
    from hkvd.transport.layout import segments_for_entry

    entry = len(block_ids) * group.block_bytes
    half = entry // 2 + 16
    return segments_for_entry(group, block_ids, [(4096, half), (4096 + half + 8192, entry - half)])


def _expected_entry(group: Any, block_ids: list[int], engine_bytes: np.ndarray) -> bytes:
    out = bytearray()
    for b in block_ids:
        for v in group.views:
            for layer in range(v.num_layers):
                off = v.offset + layer * v.layer_stride + b * v.block_stride
                out += engine_bytes[off : off + v.page_bytes].tobytes()
    return bytes(out)


def _pool_entry(pool: MmapPool, segs: list[Segment]) -> bytes:
    return b"".join(pool.array[s.pool_offset : s.pool_offset + s.nbytes].tobytes() for s in segs)


@pytest.mark.parametrize("method", ["kernel", "memcpy", "auto"])
@pytest.mark.parametrize("case", ["kv_split", "padded"])
def test_store_retrieve_round_trip(engine: Engine, pool: MmapPool, method: str, case: str) -> None:
    from hkvd.cuda.copy import CudaCopyEngine

    nbytes = 16 << 20
    regions = engine.alloc(nbytes, seed=1)
    group, block_ids = _layout(case, nbytes)
    segs = _segments(group, block_ids)
    original = engine.mod.pattern(1, nbytes)

    eng = CudaCopyEngine(pool, method=method)
    try:
        att = eng.attach(engine.proc.pid, regions)
        moved = eng.copy(att, segs, Direction.TO_POOL)
        assert moved == len(block_ids) * group.block_bytes
        assert _pool_entry(pool, segs) == _expected_entry(group, block_ids, original)

        engine.call("fill", 2)  # the engine reuses the blocks
        result = eng.copy_ordered(att, segs, Direction.FROM_POOL)
        assert result.nbytes == moved and len(result.done_event) == 64
        after = engine.read()
        overwritten = engine.mod.pattern(2, nbytes)
        touched = np.zeros(nbytes, dtype=bool)
        for b in block_ids:
            for v in group.views:
                for layer in range(v.num_layers):
                    off = v.offset + layer * v.layer_stride + b * v.block_stride
                    touched[off : off + v.page_bytes] = True
        assert np.array_equal(after[touched], original[touched]), "retrieved pages differ"
        assert np.array_equal(after[~touched], overwritten[~touched]), "retrieve wrote outside its pages"
        eng.detach(att)
    finally:
        eng.close()


def test_store_waits_for_the_engines_step_event(engine: Engine, pool: MmapPool) -> None:
    from hkvd.cuda.copy import CudaCopyEngine
    from hkvd.cuda.ipc_events import event_done

    nbytes = 8 << 20
    regions = engine.alloc(nbytes, seed=3)
    segs = [Segment(1, 0, 0, nbytes)]
    eng = CudaCopyEngine(pool, method="kernel")
    try:
        att = eng.attach(engine.proc.pid, regions)
        (handle,) = engine.call("slow_fill", 4, 500)  # 0.5 s of spinning before the write
        ev = att.state["cuda"].events.get(handle)
        assert not event_done(ev), "the engine's event completed at once: the test proves nothing"
        t0 = time.monotonic()
        eng.copy_ordered(att, segs, Direction.TO_POOL, wait_event=handle)
        assert time.monotonic() - t0 > 0.1
        assert np.array_equal(pool.array[:nbytes], engine.mod.pattern(4, nbytes)), "store read stale bytes"
        eng.detach(att)
    finally:
        eng.close()


def test_abandon_ends_a_store_waiting_on_the_engines_event(engine: Engine, pool: MmapPool) -> None:
    """Two stores gated on a slow step event are both in flight; abandon fails them at once, nothing of
    them is enqueued (the mappings close at once), and when the step ends after all, nothing runs."""
    from hkvd.cuda.copy import CudaCopyEngine

    nbytes = 1 << 20
    regions = engine.alloc(2 * nbytes, seed=9)
    pool.array[: 2 * nbytes] = 0
    eng = CudaCopyEngine(pool, method="memcpy")
    try:
        att = eng.attach(engine.proc.pid, regions)
        (handle,) = engine.call("slow_fill", 10, 3000)  # 3 s of spinning before the step ends
        first = eng.submit(att, [Segment(1, 0, 0, nbytes)], Direction.TO_POOL, wait_event=handle)
        second = eng.submit(att, [Segment(1, nbytes, nbytes, nbytes)], Direction.TO_POOL, wait_event=handle)
        assert not first.done() and not second.done()
        t0 = time.monotonic()
        eng.abandon(att)
        for t in (first, second):
            with pytest.raises(CopyFailedError, match="gone") as err:
                t.wait(2.0)
            assert PagesInUse.of(err.value) is None and t.gpu_finished.is_set()
        assert time.monotonic() - t0 < 2.0
        eng.detach(att)  # nothing was enqueued: the mappings close now, under no copy
        engine.call("read")  # the engine's step ends (its device synchronises)
        assert eng._watcher.flush(5.0)  # the gate's host function ran and enqueued nothing
        assert not pool.array[: 2 * nbytes].any(), "an abandoned copy ran after its step ended"
    finally:
        eng.close()


def test_wedged_step_event_times_out_with_nothing_enqueued(engine: Engine, pool: MmapPool) -> None:
    from hkvd.cuda.copy import CudaCopyEngine

    nbytes = 1 << 20
    regions = engine.alloc(nbytes, seed=11)
    pool.array[:nbytes] = 0
    eng = CudaCopyEngine(pool, method="memcpy", copy_timeout_s=0.5)
    try:
        att = eng.attach(engine.proc.pid, regions)
        (handle,) = engine.call("slow_fill", 12, 3000)
        with pytest.raises(KVTimeout, match="step-end event did not complete") as err:
            eng.copy_ordered(att, [Segment(1, 0, 0, nbytes)], Direction.TO_POOL, wait_event=handle)
        assert PagesInUse.of(err.value) is None
        engine.call("read")
        assert eng._watcher.flush(5.0)
        assert not pool.array[:nbytes].any(), "a timed-out copy ran once the step ended"
        eng.detach(att)
    finally:
        eng.close()


def test_retrieve_event_orders_the_engine_stream(engine: Engine, pool: MmapPool) -> None:
    from hkvd.cuda.copy import CudaCopyEngine

    nbytes = 4 << 20
    regions = engine.alloc(nbytes, seed=5)
    want = engine.mod.pattern(6, nbytes)
    pool.array[:nbytes] = want
    eng = CudaCopyEngine(pool, method="memcpy")
    try:
        att = eng.attach(engine.proc.pid, regions)
        result = eng.copy_ordered(att, [Segment(1, 0, 0, nbytes)], Direction.FROM_POOL)
        (seen,) = engine.call("wait_read", result.done_event)
        assert np.array_equal(np.frombuffer(seen, dtype=np.uint8), want)
        eng.detach(att)
    finally:
        eng.close()


def test_out_of_range_is_refused_before_any_byte(engine: Engine, pool: MmapPool) -> None:
    from hkvd.cuda.copy import CudaCopyEngine

    nbytes = 1 << 20
    regions = engine.alloc(nbytes, seed=7)
    eng = CudaCopyEngine(pool)
    try:
        att = eng.attach(engine.proc.pid, regions)
        with pytest.raises(CopyFailedError, match="leaves region 1"):
            eng.copy(att, [Segment(1, 0, 0, 4096), Segment(1, nbytes - 10, 8192, 20)], Direction.FROM_POOL)
        assert np.array_equal(engine.read(), engine.mod.pattern(7, nbytes))
        eng.detach(att)
    finally:
        eng.close()


def test_one_mapping_per_handle(engine: Engine, pool: MmapPool) -> None:
    from hkvd.cuda.copy import CudaCopyEngine
    from hkvd.cuda.ipc import REGISTRY

    regions = engine.alloc(1 << 20, seed=8, region_ids=(1, 2))  # one allocation, two regions
    assert regions[0].handle == regions[1].handle
    eng = CudaCopyEngine(pool)
    try:
        att = eng.attach(engine.proc.pid, regions)
        assert REGISTRY.refs(regions[0].handle) == 2
        att2 = eng.attach(engine.proc.pid, regions[:1])
        assert REGISTRY.refs(regions[0].handle) == 3
        eng.detach(att)
        eng.detach(att2)
        assert REGISTRY.refs(regions[0].handle) == 0
        att3 = eng.attach(engine.proc.pid, regions)  # re-opens after the last close
        assert eng.copy(att3, [Segment(2, 0, 0, 4096)], Direction.TO_POOL) == 4096
        eng.detach(att3)
    finally:
        eng.close()


def test_expandable_segments_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        import torch
    except ImportError:
        pytest.skip("torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here (CPU wheel): this case needs torch's caching allocator")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    e = Engine()  # the child reads the variable at its first CUDA allocation
    try:
        with pytest.raises(RuntimeError, match="expandable_segments"):
            e.alloc(1 << 20, seed=9)
    finally:
        e.close()


def test_hkvd_serve_with_the_cuda_engine_round_trips_through_the_wire(engine: Engine, tmp_path: Path) -> None:
    """The whole daemon: ``hkvd serve --copy-engine cuda`` opens the engine's IPC handle at
    registration, stores and retrieves over the socket, and returns a done event with the retrieve."""
    import subprocess

    from hkvd.shim.client import DaemonClient
    from hkvd.transport.keys import chunk_keys
    from hkvd.transport.layout import GroupSpec, View
    from hkvd.transport.wire.control import EngineSpec
    from hkvd.transport.wire.kv import Item

    nb, nl, page = 16, 2, 64 << 10
    nbytes = nl * nb * page
    regions = engine.alloc(nbytes, seed=21)
    sock = str(tmp_path / "hkvd.sock")
    proc = subprocess.Popen([sys.executable, "-m", "hkvd.daemon.cli", "serve", "--copy-engine", "cuda",
                             "--socket", sock, "--l1-size-gb", "0.25", "--chunk-size", "32"],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(sock):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "hkvd serve --copy-engine cuda did not start in 120 s"
            time.sleep(0.2)
        group = GroupSpec(0, "full", 16, 0, nb, "bfloat16", (View(1, 0, nl, nb * page, page, page),))
        client = DaemonClient(sock, client_name="gpu-test", role="worker", timeout_s=60)
        client.connect()
        client.register(EngineSpec("gpu-test", 1, 0, "cuda/LBHNC", 32, 16, 8192, "align", regions, [group]))
        keys = chunk_keys(list(range(64)), 32)
        before = engine.read().copy()
        stored = client.wait([client.submit_store([Item(0, c, keys[c], [1 + 2 * c, 2 + 2 * c]) for c in (0, 1)])],
                             60)
        assert all(c.ok for c in stored.values()), stored
        lookup = client.wait([client.submit_lookup(keys)], 60)
        (hit,) = lookup.values()
        assert hit.result.hit_chunks == 2
        target = [Item(0, c, keys[c], [9 + 2 * c, 10 + 2 * c]) for c in (0, 1)]
        done = client.wait([client.submit_retrieve(target, hit.result.lease_id)], 60)
        (c,) = done.values()
        assert c.ok, c.error
        assert len(c.result.event) == 64  # the engine's stream would wait on it
        after = engine.read()
        for layer in range(nl):
            for src, dst in ((1, 9), (2, 10), (3, 11), (4, 12)):
                s = layer * nb * page + src * page
                d = layer * nb * page + dst * page
                assert np.array_equal(after[d:d + page], before[s:s + page]), (layer, src, dst)
        client.close()
    finally:
        proc.terminate()
        proc.wait(30)
