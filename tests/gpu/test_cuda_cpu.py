"""CPU tests of the CUDA path's pure logic (run everywhere, no GPU, no CuPy needed).

What is covered here: descriptor building against the host copy engine and against the View
stride formula on the same layouts (executing descriptors with memmove, exactly as the kernel
and the memcpy path interpret them), coalescing, bounds checks, launch geometry and the
kernel's chunk/tail index math, UUID matching, export planning and refusals, the refcounted
IPC registry (with the CUDA runtime monkeypatched to counters), and that ``import hkvd.cuda`` needs
no CuPy. Copy ordering, completion, deferred detach and abandonment are in ``test_cuda_copy_cpu.py``;
what needs a GPU is in ``test_cuda_gpu.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from hkvd.cuda import copy as cuda_copy
from hkvd.cuda import ipc as cuda_ipc
from hkvd.cuda._cupy import CupyMissing
from hkvd.cuda.copy import CudaCopyEngine, check_method
from hkvd.cuda.descriptors import (
    DST,
    LEN,
    MAX_GRID_Y,
    SRC,
    build_descriptors,
    coalesce,
    launch_geometry,
    total_bytes,
)
from hkvd.cuda.export import PointerInfo, expandable_segments_enabled, plan_export
from hkvd.cuda.hostreg import check_registrable
from hkvd.cuda.ipc import IpcMemRegistry, match_device, normalize_uuid
from hkvd.cuda.ipc_events import check_event_handle
from hkvd.transport.copy_engine import Direction, Region, Segment
from hkvd.transport.errors import CopyFailedError, RegistrationError

# ---------------------------------------------------------------------------------------------
# Layouts: (name, region sizes, views as dicts, num_blocks, block ids, extents splitter)
# ---------------------------------------------------------------------------------------------

PAGE = 4096


def _v(region_id: int, offset: int, num_layers: int, layer_stride: int, block_stride: int,
       page_bytes: int) -> dict[str, int]:
    return {"region_id": region_id, "offset": offset, "num_layers": num_layers,
            "layer_stride": layer_stride, "block_stride": block_stride, "page_bytes": page_bytes}


def _layouts() -> list[tuple[str, dict[int, int], list[dict[str, int]], int]]:
    nb, nl = 9, 3
    return [
        # Block-major: one block holds every layer's page back to back (BL).
        ("block_major", {1: nb * nl * PAGE}, [_v(1, 0, nl, PAGE, nl * PAGE, PAGE)], nb),
        # Layer-major (LB): layer l is a slab of num_blocks pages.
        ("layer_major", {1: nb * nl * PAGE}, [_v(1, 0, nl, nb * PAGE, PAGE, PAGE)], nb),
        # vLLM flash-attn per layer [2, num_blocks, ...]: K and V views of one region, strided.
        ("kv_split", {1: nl * 2 * nb * PAGE},
         [_v(1, 0, nl, 2 * nb * PAGE, PAGE, PAGE), _v(1, nb * PAGE, nl, 2 * nb * PAGE, PAGE, PAGE)], nb),
        # Mamba-like padded, unaligned pages in two regions (exercises the kernel's byte path).
        ("padded_unaligned", {1: 8 + nb * 1032 * nl, 2: 3 + nb * 520},
         [_v(1, 8, nl, 1032, 1032 * nl, 1000), _v(2, 3, 1, 0, 520, 517)], nb),
    ]


@dataclass
class Case:
    name: str
    group: Any  # GroupSpec
    engine: dict[int, np.ndarray]  # region id -> bytes
    block_ids: list[int]
    extents: list[tuple[int, int]]
    pool_size: int


def _case(name: str, sizes: dict[int, int], views: list[dict[str, int]], nb: int, seed: int = 0) -> Case:
    layout = pytest.importorskip("hkvd.transport.layout")
    rng = np.random.default_rng(seed)
    group = layout.GroupSpec(group_id=0, kind="full", tokens_per_block=16, window_tokens=0, num_blocks=nb,
                             dtype="bfloat16", views=tuple(layout.View(**v) for v in views))
    group.validate(sizes)
    engine = {rid: rng.integers(0, 256, size, dtype=np.uint8) for rid, size in sizes.items()}
    block_ids = [3, 1, 7, 2]
    entry = len(block_ids) * group.block_bytes
    # Two extents, the split falling mid-page, and a gap between them in the pool.
    first = entry // 2 + 5
    extents = [(64, first), (64 + first + 4096, entry - first)]
    return Case(name, group, engine, block_ids, extents, pool_size=64 + entry + 8192)




@pytest.fixture(params=[lt[0] for lt in _layouts()])
def case(request: pytest.FixtureRequest) -> Case:
    for lt in _layouts():
        if lt[0] == request.param:
            return _case(*lt)
    raise AssertionError(request.param)


def _addr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def _execute(desc: np.ndarray) -> int:
    """The reference executor: what the kernel / memcpy path do with each row, on CPU."""
    for src, dst, n in desc.tolist():
        ctypes.memmove(dst, src, n)
    return total_bytes(desc)


def _segments(c: Case) -> list[Segment]:
    from hkvd.transport.layout import segments_for_entry

    return segments_for_entry(c.group, c.block_ids, c.extents)


def _descriptors(c: Case, engine: dict[int, np.ndarray], pool: np.ndarray, d: Direction) -> np.ndarray:
    return build_descriptors(
        _segments(c), d,
        region_bases={rid: _addr(a) for rid, a in engine.items()},
        region_sizes={rid: a.size for rid, a in engine.items()},
        pool_base=_addr(pool), pool_size=pool.size,
    )


def _expected_entry(c: Case) -> bytes:
    """The entry's logical bytes straight from the View formula (independent of the code under test)."""
    out = bytearray()
    for b in c.block_ids:
        for v in c.group.views:
            for layer in range(v.num_layers):
                off = v.offset + layer * v.layer_stride + b * v.block_stride
                out += c.engine[v.region_id][off : off + v.page_bytes].tobytes()
    return bytes(out)


def _pool_entry(c: Case, pool: np.ndarray) -> bytes:
    return b"".join(pool[o : o + n].tobytes() for o, n in c.extents)


# ---------------------------------------------------------------------------------------------
# Descriptors
# ---------------------------------------------------------------------------------------------


def test_store_descriptors_follow_the_view_formula(case: Case) -> None:
    pool = np.zeros(case.pool_size, dtype=np.uint8)
    desc = _descriptors(case, case.engine, pool, Direction.TO_POOL)
    assert desc.dtype == np.int64 and desc.flags.c_contiguous and desc.shape[1] == 3
    assert _execute(desc) == len(case.block_ids) * case.group.block_bytes
    assert _pool_entry(case, pool) == _expected_entry(case)
    # Bytes outside the extents are untouched.
    mask = np.ones(pool.size, dtype=bool)
    for o, n in case.extents:
        mask[o : o + n] = False
    assert not pool[mask].any()


def test_descriptors_equal_what_the_host_engine_copies(case: Case) -> None:
    cma = pytest.importorskip("hkvd.daemon.engines.host_engine")

    @dataclass
    class _Pool:
        base_addr: int
        size: int

    pool_host = np.zeros(case.pool_size, dtype=np.uint8)
    pool_cuda = np.zeros(case.pool_size, dtype=np.uint8)
    host = cma.HostCopyEngine(_Pool(_addr(pool_host), pool_host.size))
    regions = [Region(rid, "host", a.size, addr=_addr(a)) for rid, a in case.engine.items()]
    att = host.attach(os.getpid(), regions)
    segs = _segments(case)

    moved = host.copy(att, segs, Direction.TO_POOL)
    assert _execute(_descriptors(case, case.engine, pool_cuda, Direction.TO_POOL)) == moved
    assert pool_host.tobytes() == pool_cuda.tobytes()

    # Retrieve into two identical engine copies from one pool: same bytes land.
    rng = np.random.default_rng(7)
    pool_host[:] = rng.integers(0, 256, pool_host.size, dtype=np.uint8)
    eng_host = {rid: a.copy() for rid, a in case.engine.items()}
    eng_cuda = {rid: a.copy() for rid, a in case.engine.items()}
    regions2 = [Region(rid, "host", a.size, addr=_addr(a)) for rid, a in eng_host.items()]
    att2 = host.attach(os.getpid(), regions2)
    moved = host.copy(att2, segs, Direction.FROM_POOL)
    assert _execute(_descriptors(case, eng_cuda, pool_host, Direction.FROM_POOL)) == moved
    for rid in eng_host:
        assert eng_host[rid].tobytes() == eng_cuda[rid].tobytes()
    host.detach(att)
    host.detach(att2)


def test_round_trip_and_direction_swap(case: Case) -> None:
    pool = np.zeros(case.pool_size, dtype=np.uint8)
    store = _descriptors(case, case.engine, pool, Direction.TO_POOL)
    _execute(store)
    wiped = {rid: np.zeros_like(a) for rid, a in case.engine.items()}
    retrieve = _descriptors(case, wiped, pool, Direction.FROM_POOL)
    _execute(retrieve)
    # Retrieve rows are store rows with src/dst swapped (engine bases differ: compare offsets).
    assert np.array_equal(store[:, LEN], retrieve[:, LEN])
    assert np.array_equal(store[:, DST], retrieve[:, SRC])
    for v in case.group.views:
        for b in case.block_ids:
            for layer in range(v.num_layers):
                off = v.offset + layer * v.layer_stride + b * v.block_stride
                sl = slice(off, off + v.page_bytes)
                assert wiped[v.region_id][sl].tobytes() == case.engine[v.region_id][sl].tobytes()


def test_coalesce_preserves_bytes_and_merges_contiguous_runs(case: Case) -> None:
    pool_a = np.zeros(case.pool_size, dtype=np.uint8)
    pool_b = np.zeros(case.pool_size, dtype=np.uint8)
    desc = _descriptors(case, case.engine, pool_a, Direction.TO_POOL)
    _execute(desc)
    merged = coalesce(_descriptors(case, case.engine, pool_b, Direction.TO_POOL))
    assert total_bytes(merged) == total_bytes(desc)
    assert merged.shape[0] <= desc.shape[0]
    _execute(merged)
    assert pool_a.tobytes() == pool_b.tobytes()


def test_coalesce_needs_contiguity_on_both_sides() -> None:
    d = np.array([[0, 1000, 10], [10, 1010, 6], [16, 2000, 4], [30, 2004, 4]], dtype=np.int64)
    out = coalesce(d)
    assert out.tolist() == [[0, 1000, 16], [16, 2000, 4], [30, 2004, 4]]
    assert coalesce(d[:1]).tolist() == d[:1].tolist()


def _bounds_args() -> dict[str, Any]:
    return {"region_bases": {1: 1 << 20}, "region_sizes": {1: 4096}, "pool_base": 1 << 30, "pool_size": 8192}


@pytest.mark.parametrize(
    ("seg", "match"),
    [
        (Segment(1, 4000, 0, 97), "leaves region 1"),
        (Segment(1, -1, 0, 10), "leaves region 1"),
        (Segment(1, 0, 0, -5), "leaves region 1"),
        (Segment(1, 0, 8190, 10), "leaves the pool"),
        (Segment(1, 0, -16, 10), "leaves the pool"),
        (Segment(9, 0, 0, 10), "region 9, which is not registered"),
    ],
)
def test_bounds_are_checked_before_any_row(seg: Segment, match: str) -> None:
    ok = Segment(1, 0, 0, 16)
    with pytest.raises(CopyFailedError, match=match):
        build_descriptors([ok, seg], Direction.TO_POOL, **_bounds_args())


def test_exact_fit_and_zero_length_rows() -> None:
    segs = [Segment(1, 0, 0, 4096), Segment(1, 100, 4096, 0), Segment(1, 4095, 8191, 1)]
    d = build_descriptors(segs, Direction.TO_POOL, **_bounds_args())
    assert d.tolist() == [[1 << 20, 1 << 30, 4096], [(1 << 20) + 4095, (1 << 30) + 8191, 1]]
    assert build_descriptors([], Direction.FROM_POOL, **_bounds_args()).shape == (0, 3)


# ---------------------------------------------------------------------------------------------
# Launch geometry and the kernel's index math
# ---------------------------------------------------------------------------------------------


def test_launch_geometry() -> None:
    d = np.array([[0, 0, 8 << 20], [0, 0, 64 << 10], [0, 0, 100]], dtype=np.int64)
    g = launch_geometry(d, 64 << 10)
    assert (g.grid_x, g.grid_y) == (3, 128)
    huge = np.array([[0, 0, 1 << 40]], dtype=np.int64)
    assert launch_geometry(huge, 64 << 10).grid_y == MAX_GRID_Y
    assert launch_geometry(np.empty((0, 3), dtype=np.int64)).grid_x == 0
    with pytest.raises(ValueError, match="multiple of 16"):
        launch_geometry(d, 1000)


def _emulate_row(src: int, dst: int, length: int, chunk: int, grid_y: int, bd: int) -> np.ndarray:
    """Python transcription of KERNEL_SOURCE for one row: how often each byte is written."""
    hits = np.zeros(length, dtype=np.int64)
    vec = ((src | dst) & 15) == 0
    for by in range(grid_y):
        start = by * chunk
        while start < length:
            end = min(start + chunk, length)
            tail = start
            if vec:
                nvec = (end - start) >> 4
                for tid in range(bd):
                    k = tid
                    while k + 3 * bd < nvec:
                        for j in range(4):
                            o = start + 16 * (k + j * bd)
                            hits[o : o + 16] += 1
                        k += 4 * bd
                    while k < nvec:
                        o = start + 16 * k
                        hits[o : o + 16] += 1
                        k += bd
                tail = start + (nvec << 4)
            for tid in range(bd):
                hits[tail + tid : end : bd] += 1
            start += grid_y * chunk
    return hits


@pytest.mark.parametrize(
    ("src", "dst", "length", "grid_y"),
    [(0, 0, 4096, 1), (0, 16, 4096 + 48, 2), (0, 0, 1000, 1), (3, 0, 700, 3), (0, 0, 64 * 5 + 17, 2),
     (16, 32, 16 * 33, 1)],
)
def test_kernel_index_math_writes_every_byte_once(src: int, dst: int, length: int, grid_y: int) -> None:
    assert "k + 3 * bd < nvec" in cuda_copy.KERNEL_SOURCE  # the emulation mirrors this source
    hits = _emulate_row(src, dst, length, chunk=64, grid_y=grid_y, bd=4)
    assert hits.min() == 1 and hits.max() == 1


# ---------------------------------------------------------------------------------------------
# UUIDs, export planning, small validators
# ---------------------------------------------------------------------------------------------

U0 = "GPU-0a1b2c3d-0000-1111-2222-333344445555"
U1 = "GPU-ffffffff-eeee-dddd-cccc-bbbbaaaa9999"


def test_normalize_uuid_forms() -> None:
    raw = bytes.fromhex("0a1b2c3d000011112222333344445555")
    assert normalize_uuid(raw) == U0
    assert normalize_uuid(U0.upper()) == U0
    assert normalize_uuid(U0[4:]) == U0  # torch's bare form
    assert normalize_uuid("0a1b2c3d000011112222333344445555") == U0
    assert normalize_uuid("MIG-" + U0[4:]).startswith("MIG-")
    for bad in ("GPU-xyz", "", b"\x00" * 15):
        with pytest.raises(ValueError):
            normalize_uuid(bad)


def test_match_device() -> None:
    assert match_device(U1, [U0, U1]) == 1
    assert match_device(U0[4:], [bytes.fromhex(U0[4:].replace("-", "")), U1]) == 0
    with pytest.raises(RegistrationError, match=r"not visible to the daemon.*CUDA_VISIBLE_DEVICES"):
        match_device(U1, [U0])
    with pytest.raises(RegistrationError, match="no GPU"):
        match_device(U1, [])
    with pytest.raises(RegistrationError, match="bad device_uuid"):
        match_device("nonsense", [U0])
    # A MIG instance is not its parent GPU.
    with pytest.raises(RegistrationError):
        match_device("MIG-" + U0[4:], [U0])


def test_plan_export_offset_and_refusals() -> None:
    info = PointerInfo(range_start=0x7000_0000, range_size=1 << 20, legacy_ipc_capable=True, device=0)
    assert plan_export(0x7000_0000 + 4096, 8192, info) == 4096
    assert plan_export(0x7000_0000, 1 << 20, info) == 0
    with pytest.raises(RegistrationError, match="not inside one CUDA allocation"):
        plan_export(0x7000_0000 + 4096, 1 << 20, info)
    with pytest.raises(RegistrationError, match="empty"):
        plan_export(0x7000_0000, 0, info)
    vmm = PointerInfo(0x7000_0000, 1 << 20, legacy_ipc_capable=False, device=0)
    with pytest.raises(RegistrationError, match=r"expandable_segments.*ALLOC_CONF without expandable"):
        plan_export(0x7000_0000, 16, vmm, "expandable_segments:True")
    with pytest.raises(RegistrationError, match=r"not from cudaMalloc.*PYTORCH_CUDA_ALLOC_CONF"):
        plan_export(0x7000_0000, 16, vmm, None)


@pytest.mark.parametrize(
    ("conf", "on"),
    [
        (None, False),
        ("", False),
        ("expandable_segments:True", True),
        ("max_split_size_mb:64,expandable_segments:True", True),
        ("expandable_segments:False", False),
        ("expandable_segments:True,expandable_segments:False", False),
    ],
)
def test_expandable_segments_parse(conf: str | None, on: bool) -> None:
    assert expandable_segments_enabled(conf) is on


def test_small_validators() -> None:
    check_registrable(4096 * 7, 1)
    with pytest.raises(ValueError, match="page-aligned"):
        check_registrable(4097, 4096)
    with pytest.raises(ValueError, match="positive"):
        check_registrable(4096, 0)
    check_event_handle(b"\x01" * 64)
    with pytest.raises(ValueError, match="64 bytes"):
        check_event_handle(b"\x01" * 63)
    assert check_method("memcpy") == "memcpy"
    with pytest.raises(ValueError, match="kernel"):
        check_method("dma")
    with pytest.raises(RegistrationError, match="64 bytes"):
        cuda_ipc.check_region_fields(1, b"x", 10, 0)


# ---------------------------------------------------------------------------------------------
# Refcounted IPC mappings and deferred detach, with the CUDA runtime replaced by counters
# ---------------------------------------------------------------------------------------------


class _CountingRuntime:
    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self) -> None:
        self.opened: dict[int, bytes] = {}
        self.closed: list[int] = []
        self._next = 0x10_0000_0000

    def ipcOpenMemHandle(self, handle: bytes, flags: int) -> int:
        if handle in self.opened.values():
            raise RuntimeError("cudaErrorInvalidValue: handle already opened in this process")
        self._next += 1 << 30
        self.opened[self._next] = handle
        return self._next

    def ipcCloseMemHandle(self, ptr: int) -> None:
        del self.opened[ptr]
        self.closed.append(ptr)

    def eventDestroy(self, ev: int) -> None:  # OpenedEvents.close with nothing opened never calls it
        raise AssertionError("no event was opened")


class _FakeCupy:
    class cuda:
        @staticmethod
        @contextlib.contextmanager
        def Device(i: int) -> Iterator[None]:
            yield


@pytest.fixture
def counting_runtime(monkeypatch: pytest.MonkeyPatch) -> _CountingRuntime:
    rt = _CountingRuntime()
    for mod in ("hkvd.cuda.ipc", "hkvd.cuda.ipc_events", "hkvd.cuda.copy"):
        monkeypatch.setattr(f"{mod}.runtime", lambda: rt)
        monkeypatch.setattr(f"{mod}.cupy", lambda: _FakeCupy)
    monkeypatch.setattr(cuda_ipc, "REGISTRY", IpcMemRegistry())
    monkeypatch.setattr(cuda_copy, "REGISTRY", cuda_ipc.REGISTRY)
    monkeypatch.setattr(cuda_copy, "visible_device_uuids", lambda: [U0, U1])
    return rt


def test_registry_opens_once_and_last_release_unmaps(counting_runtime: _CountingRuntime) -> None:
    reg = cuda_ipc.REGISTRY
    h = b"\x07" * 64
    p = reg.acquire(h, 1)
    assert reg.acquire(h, 1) == p and reg.refs(h) == 2
    with pytest.raises(RegistrationError, match="already opened on device 1"):
        reg.acquire(h, 0)
    reg.release(h)
    assert counting_runtime.closed == []
    reg.release(h)
    assert counting_runtime.closed == [p]
    reg.release(h)  # unknown now: a no-op
    assert reg.acquire(h, 1) != 0  # can be opened again after the last close


def _engine() -> CudaCopyEngine:
    @dataclass
    class _Pool:
        base_addr: int = 1 << 40
        size: int = 1 << 20

    return CudaCopyEngine(_Pool(), method="memcpy", register_pool=False)


def test_attach_matches_uuid_and_shares_handles(counting_runtime: _CountingRuntime) -> None:
    eng = _engine()
    h = b"\x01" * 64
    regions = [
        Region(1, "cuda", 4096, handle=h, device_uuid=U1[4:], offset=0),
        Region(2, "cuda", 4096, handle=h, device_uuid=U1, offset=8192),  # same allocation
    ]
    att = eng.attach(1234, regions)
    st = att.state["cuda"]
    assert st.device == 1
    assert st.bases[2] - st.bases[1] == 8192
    assert len(counting_runtime.opened) == 1 and cuda_ipc.REGISTRY.refs(h) == 2
    eng.detach(att)
    eng.detach(att)  # idempotent
    assert len(counting_runtime.opened) == 0 and len(counting_runtime.closed) == 1
    eng.close()


@pytest.mark.parametrize(
    ("regions", "match"),
    [
        ([Region(1, "host", 10, addr=4096)], "kind 'host'"),
        ([Region(1, "cuda", 10, handle=b"\x01" * 64, device_uuid="GPU-" + "9" * 32)], "not visible"),
        ([Region(1, "cuda", 10, handle=b"\x01" * 64, device_uuid=U0),
          Region(2, "cuda", 10, handle=b"\x02" * 64, device_uuid=U1)], "span GPUs"),
        ([Region(1, "cuda", 10, handle=b"\x01" * 64, device_uuid=U0),
          Region(1, "cuda", 10, handle=b"\x02" * 64, device_uuid=U0)], "registered twice"),
    ],
)
def test_attach_refusals_open_nothing(
    counting_runtime: _CountingRuntime, regions: list[Region], match: str
) -> None:
    eng = _engine()
    with pytest.raises(RegistrationError, match=match):
        eng.attach(1, regions)
    assert counting_runtime.opened == {}


def test_out_of_range_copy_is_refused(counting_runtime: _CountingRuntime) -> None:
    eng = _engine()
    att = eng.attach(2, [Region(1, "cuda", 4096, handle=b"\x04" * 64, device_uuid=U0)])
    with pytest.raises(CopyFailedError, match="leaves region"):
        eng.copy(att, [Segment(1, 4000, 0, 200)], Direction.FROM_POOL)
    eng.close()


# ---------------------------------------------------------------------------------------------
# Packaging: no CuPy needed to import, clear error when it is used
# ---------------------------------------------------------------------------------------------


def test_import_hkvd_cuda_does_not_import_cupy(tmp_path: Any) -> None:
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import hkvd.cuda, hkvd.cuda.copy, hkvd.cuda.export, hkvd.cuda.ipc_events, hkvd.cuda.hostreg, "
        "hkvd.cuda.ipc, hkvd.cuda.descriptors\n"
        "assert sys.modules['cupy'] is None\n"
        "from hkvd.cuda._cupy import CupyMissing, cupy, device_count\n"
        "assert device_count() == 0\n"
        "try:\n    cupy()\nexcept CupyMissing as e:\n    assert \"pip install -e '.[gpu]'\" in str(e), e\n"
        "else:\n    raise AssertionError('no error')\n"
    )
    # cwd outside the repo: a script run from the root would put ./cuda on sys.path (see house style).
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_engine_without_cupy_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)

    @dataclass
    class _Pool:
        base_addr: int = 4096
        size: int = 4096

    # Run as ``python -m pytest`` from the checkout's root, the checkout's cuda/ shadows NVIDIA's, and the
    # error names that fix instead.
    with pytest.raises(CupyMissing, match=r"GPU extra|Run from another directory"):
        CudaCopyEngine(_Pool())
