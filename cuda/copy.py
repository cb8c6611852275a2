"""CUDA copy engine: batched gather/scatter between IPC-opened GPU memory and the pinned pool.

Role
    ``CudaCopyEngine`` implements ``hkvd.transport.copy_engine.CopyEngine`` for regions of kind
    "cuda". ``attach`` matches the engine's GPU by UUID and opens its IPC handles once per
    process (``hkvd.cuda.ipc``); ``copy`` turns segments into ``(src, dst, nbytes)``
    descriptors (``hkvd.cuda.descriptors``) and moves them on the daemon's own stream, by
    - ``method="kernel"``: one launch of a gather/scatter kernel for the whole batch. Block
      (x, y) copies 64 KiB chunks y, y+gridDim.y, ... of row x, 16 bytes per thread per load
      when both ends are 16-byte aligned (bytes otherwise), reading device memory and writing
      mapped pinned host memory for stores, and the reverse for retrieves; or
    - ``method="memcpy"``: one ``cudaMemcpyAsync`` per (coalesced) row, driven by the DMA
      copy engines (``cudaMemcpyBatchAsync`` needs CUDA 12.8 and is not wrapped by CuPy).
    The default is "kernel"; ``bench/gpu_copy.py`` measures both against one contiguous pinned
    ``cudaMemcpy`` and decides (run it on the target GPU and update ``DEFAULT_METHOD``).

Ordering
    A store may carry the engine's step-end IPC event (``copy_ordered(wait_event=...)``): the
    copy thread first polls it with the copy budget (so a wedged engine times out with nothing
    enqueued), then ``cudaStreamWaitEvent`` orders the stream after it (ordering by
    construction), then the copy runs. Every copy ends by recording one of the daemon's
    interprocess events; its handle is returned so the shim can make the engine stream wait on
    it before a forward reads retrieved blocks. The engine's host thread never blocks.

Threading
    ``attach``/``detach`` run on the event loop (each IPC open maps an allocation: ~ms).
    ``copy`` blocks and runs on the daemon's copy threads: each thread gets its own stream,
    descriptor buffers and event ring per device (``BatchCopier``), so threads never share
    mutable GPU state, and ``copy`` waits for its own work (event poll with a budget) before
    returning. A ``detach`` while copies of that engine are in flight is deferred: the last
    copy releases the IPC mappings.

Failure
    Out-of-range segments raise ``CopyFailedError`` before anything is enqueued. A copy that
    does not complete within ``copy_timeout_s`` raises ``KVTimeout``; its stream and buffers
    are abandoned (kept referenced, never reused: the GPU may still read them) and the thread
    gets fresh ones. An asynchronous CUDA fault raises ``CopyFailedError``; CUDA faults are
    sticky for the context, so the daemon should then stop using the device.

Lifecycle
    Build once at daemon start (registers the pool: ``hkvd.cuda.hostreg``), ``close()`` once at
    shutdown after the copy threads have drained (it detaches what is still attached, then
    unregisters the pool, which no copy may still be using).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hkvd.cuda._cupy import cupy, runtime
from hkvd.cuda.descriptors import (
    DEFAULT_CHUNK_BYTES,
    build_descriptors,
    coalesce,
    launch_geometry,
    total_bytes,
)
from hkvd.cuda.hostreg import PinnedRegistration, PoolLike
from hkvd.cuda.ipc import REGISTRY, check_region_fields, match_device, visible_device_uuids
from hkvd.cuda.ipc_events import IpcEventRing, OpenedEvents, wait_event_host
from hkvd.transport.copy_engine import Attachment, CopyEngine, CopyResult, Direction, EngineProcess, Region, Segment
from hkvd.transport.errors import CopyFailedError, KVError, RegistrationError

METHODS = ("kernel", "memcpy")
# bench/gpu_copy.py prints both paths' GB/s per page size next to pinned cudaMemcpy (docs/gpu.md has
# the figures): the kernel held up across page sizes, memcpy only at large pages. Measure on a new
# GPU before switching.
DEFAULT_METHOD = "kernel"
DEFAULT_THREADS_PER_BLOCK = 256
# A copy of 1 GiB at a pessimistic 10 GB/s takes 0.1 s; the budget also covers the wait for
# the engine's step event (a forward of a long prefill can take seconds).
DEFAULT_COPY_TIMEOUT_S = 30.0

KERNEL_NAME = "hkvd_gather_scatter"
KERNEL_SOURCE = r"""
extern "C" __global__ void hkvd_gather_scatter(const long long* __restrict__ desc,
                                               const long long chunk_bytes)
{
    const long long row = blockIdx.x;
    const char* __restrict__ src = reinterpret_cast<const char*>(desc[3 * row]);
    char* __restrict__ dst = reinterpret_cast<char*>(desc[3 * row + 1]);
    const long long len = desc[3 * row + 2];
    const long long bd = blockDim.x;
    const long long tid = threadIdx.x;
    // chunk_bytes is a multiple of 16, so every chunk start keeps 16-byte alignment.
    const bool vec = ((reinterpret_cast<unsigned long long>(src) |
                       reinterpret_cast<unsigned long long>(dst)) & 15ULL) == 0;
    for (long long start = (long long)blockIdx.y * chunk_bytes; start < len;
         start += (long long)gridDim.y * chunk_bytes) {
        const long long end = (start + chunk_bytes < len) ? start + chunk_bytes : len;
        long long tail = start;
        if (vec) {
            const long long nvec = (end - start) >> 4;
            const int4* __restrict__ s = reinterpret_cast<const int4*>(src + start);
            int4* __restrict__ d = reinterpret_cast<int4*>(dst + start);
            long long k = tid;
            // Four loads in flight per thread before the stores: reads of host memory over
            // PCIe (retrieve) are latency-bound, and this quadruples the outstanding requests.
            for (; k + 3 * bd < nvec; k += 4 * bd) {
                const int4 a = s[k];
                const int4 b = s[k + bd];
                const int4 c = s[k + 2 * bd];
                const int4 e = s[k + 3 * bd];
                d[k] = a;
                d[k + bd] = b;
                d[k + 2 * bd] = c;
                d[k + 3 * bd] = e;
            }
            for (; k < nvec; k += bd) {
                d[k] = s[k];
            }
            tail = start + (nvec << 4);
        }
        for (long long t = tail + tid; t < end; t += bd) {
            dst[t] = src[t];
        }
    }
}
"""

_kernel_lock = threading.Lock()
_kernel: Any = None


def _get_kernel() -> Any:
    """The process's RawKernel (CuPy compiles it per device on first use and caches on disk)."""
    global _kernel
    with _kernel_lock:
        if _kernel is None:
            _kernel = cupy().RawKernel(KERNEL_SOURCE, KERNEL_NAME)
        return _kernel


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


class BatchCopier:
    """One thread's GPU state on one device: stream, kernel, descriptor buffers, done events.

    Not thread-safe: owned by exactly one copy thread (or by the bench). ``run`` is the whole
    data path and is also what ``bench/gpu_copy.py`` measures.
    """

    def __init__(
        self,
        device: int,
        *,
        threads_per_block: int = DEFAULT_THREADS_PER_BLOCK,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        cp = cupy()
        self.device = device
        self.threads_per_block = threads_per_block
        self.chunk_bytes = chunk_bytes
        self.broken = False
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.kernel = _get_kernel()
            compile_fn = getattr(self.kernel, "compile", None)
            if compile_fn is not None:
                compile_fn()  # surface nvrtc problems now, not in the middle of a copy
            self.events = IpcEventRing(device)
        self._cap = 0
        self._host: Any = None  # pinned staging (numpy view over cupy pinned memory)
        self._host_mem: Any = None
        self._dev: Any = None

    def _ensure_capacity(self, rows: int) -> None:
        if rows <= self._cap:
            return
        cp = cupy()
        cap = max(rows, 2 * self._cap, 1024)
        with cp.cuda.Device(self.device):
            self._host_mem = cp.cuda.alloc_pinned_memory(cap * 3 * 8)
            self._host = np.frombuffer(self._host_mem, dtype=np.int64, count=cap * 3).reshape(cap, 3)
            self._dev = cp.empty(cap * 3, dtype=cp.int64)
        self._cap = cap

    def run(
        self,
        desc: np.ndarray,
        method: str,
        *,
        wait_event_ptr: int = 0,
        timeout_s: float = DEFAULT_COPY_TIMEOUT_S,
    ) -> CopyResult:
        """Move every row of ``desc``; block until done (within ``timeout_s``). See the module docstring."""
        check_method(method)
        if self.broken:
            raise CopyFailedError("this copier was abandoned after a timeout")
        rt = runtime()
        cp = cupy()
        with cp.cuda.Device(self.device):
            if wait_event_ptr:
                # Poll first: a wedged engine times out here with nothing enqueued on our stream.
                wait_event_host(wait_event_ptr, timeout_s, "the engine's step event")
                rt.streamWaitEvent(self.stream.ptr, wait_event_ptr, 0)
            n = int(desc.shape[0])
            if n:
                if method == "kernel":
                    self._launch_kernel(desc)
                else:
                    s = self.stream.ptr
                    kind = rt.memcpyDefault  # unified addressing: the driver reads both pointers' kinds
                    for src, dst, nbytes in desc.tolist():
                        rt.memcpyAsync(dst, src, nbytes, kind, s)
            ev, handle = self.events.record(self.stream.ptr)
            try:
                wait_event_host(ev, timeout_s, f"a {n}-row copy on device {self.device}")
            except KVError:
                self.broken = True  # the GPU may still run it: never reuse this stream or its buffers
                raise
            except Exception as e:
                self.broken = True
                raise CopyFailedError(f"CUDA copy on device {self.device} failed: {e}") from e
        return CopyResult(total_bytes(desc), handle)

    def _launch_kernel(self, desc: np.ndarray) -> None:
        geo = launch_geometry(desc, self.chunk_bytes)
        n = geo.grid_x
        self._ensure_capacity(n)
        self._host[:n] = desc
        rt = runtime()
        # Safe to overwrite the staging: the previous run() waited for its kernel to finish.
        rt.memcpyAsync(self._dev.data.ptr, self._host_mem.ptr, n * 24, rt.memcpyHostToDevice, self.stream.ptr)
        self.kernel(
            (geo.grid_x, geo.grid_y),
            (self.threads_per_block,),
            (self._dev, np.int64(geo.chunk_bytes)),
            stream=self.stream,
        )


@dataclass(slots=True)
class _CudaState:
    """Per attachment; guarded by ``lock``. Mappings are released by whoever drops the last user."""

    device: int
    bases: dict[int, int]
    sizes: dict[int, int]
    handles: list[bytes]
    events: Any  # OpenedEvents
    lock: threading.Lock = field(default_factory=threading.Lock)
    inflight: int = 0
    detaching: bool = False
    released: bool = False


def _release(st: _CudaState) -> None:
    st.events.close()
    for h in st.handles:
        REGISTRY.release(h)


class CudaCopyEngine(CopyEngine):
    """Copy engine for "cuda" regions. See the module docstring.

    ``pool`` needs ``base_addr`` and ``size`` (a ``HugePagePool``); it is registered as pinned
    here unless ``register_pool=False`` (the caller then guarantees it is registered).
    """

    name = "cuda"

    def __init__(
        self,
        pool: PoolLike,
        *,
        method: str = DEFAULT_METHOD,
        copy_timeout_s: float = DEFAULT_COPY_TIMEOUT_S,
        threads_per_block: int = DEFAULT_THREADS_PER_BLOCK,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        register_pool: bool = True,
    ) -> None:
        self.method = check_method(method)
        self.copy_timeout_s = copy_timeout_s
        self._tpb = threads_per_block
        self._chunk = chunk_bytes
        self._pool_base = pool.base_addr
        self._pool_size = pool.size
        self._visible = visible_device_uuids()
        if not self._visible:
            raise RuntimeError("the CUDA copy engine needs a GPU, and the daemon sees none")
        self._pinned = PinnedRegistration.for_pool(pool) if register_pool else None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._copiers: list[BatchCopier] = []
        self._abandoned: list[BatchCopier] = []
        self._attached: list[Attachment] = []
        self._closed = False

    # -- attach / detach (event loop) -------------------------------------------------------

    def attach(self, pid: int | EngineProcess, regions: list[Region]) -> Attachment:
        # IPC handles name device memory, not the process: the pid is kept for messages only.
        pid = pid if isinstance(pid, int) else pid.pid
        if self._closed:
            raise RegistrationError("the CUDA copy engine is closed")
        by_id: dict[int, Region] = {}
        for r in regions:
            if r.kind != "cuda":
                raise RegistrationError(
                    f"region {r.region_id} is of kind {r.kind!r}; the cuda copy engine only copies 'cuda' "
                    "regions (register host memory with the host engine)"
                )
            if r.region_id in by_id:
                raise RegistrationError(f"region id {r.region_id} is registered twice")
            check_region_fields(r.region_id, r.handle, r.size, r.offset)
            by_id[r.region_id] = r
        devices = {match_device(r.device_uuid, self._visible) for r in by_id.values()}
        if len(devices) > 1:
            raise RegistrationError(
                f"one engine's regions span GPUs {sorted(devices)}; register one GPU per rank"
            )
        device = devices.pop() if devices else 0
        if self.method == "kernel":
            self._check_kernel_can_reach_pool(device)
        opened: list[bytes] = []
        bases: dict[int, int] = {}
        try:
            for r in by_id.values():
                ptr = REGISTRY.acquire(r.handle, device)
                opened.append(r.handle)
                bases[r.region_id] = ptr + r.offset
        except BaseException:
            for h in opened:
                REGISTRY.release(h)
            raise
        st = _CudaState(
            device=device,
            bases=bases,
            sizes={r.region_id: r.size for r in by_id.values()},
            handles=opened,
            events=OpenedEvents(device),
        )
        att = Attachment(pid=pid, regions=by_id, state={"cuda": st})
        with self._lock:
            self._attached.append(att)
        return att

    def _check_kernel_can_reach_pool(self, device: int) -> None:
        rt = runtime()
        if not rt.deviceGetAttribute(rt.cudaDevAttrCanUseHostPointerForRegisteredMem, device):
            raise RegistrationError(
                f"GPU {device} cannot use registered host pointers directly, so the copy kernel cannot "
                "reach the pool; build the engine with method='memcpy'"
            )

    def detach(self, attachment: Attachment) -> None:
        st: _CudaState | None = attachment.state.get("cuda")
        if st is None:
            return
        with st.lock:
            if st.detaching:
                return
            st.detaching = True
            release_now = st.inflight == 0 and not st.released
            if release_now:
                st.released = True
        if release_now:
            _release(st)
        with self._lock:
            if attachment in self._attached:
                self._attached.remove(attachment)

    # -- copy (copy threads) ----------------------------------------------------------------

    def copy(self, attachment: Attachment, segments: list[Segment], direction: Direction) -> int:
        return self.copy_ordered(attachment, segments, direction).nbytes

    def copy_ordered(
        self,
        attachment: Attachment,
        segments: list[Segment],
        direction: Direction,
        *,
        wait_event: bytes | None = None,
    ) -> CopyResult:
        """``copy`` plus IPC-event ordering: wait for ``wait_event`` (the engine's step-end event)
        before reading; return the handle of the event recorded after writing."""
        st: _CudaState | None = attachment.state.get("cuda")
        if st is None:
            raise CopyFailedError("attachment was not made by the cuda copy engine")
        desc = coalesce(
            build_descriptors(
                segments,
                direction,
                region_bases=st.bases,
                region_sizes=st.sizes,
                pool_base=self._pool_base,
                pool_size=self._pool_size,
            )
        )
        with st.lock:
            if st.detaching:
                raise CopyFailedError(f"engine pid {attachment.pid} was detached")
            st.inflight += 1
        try:
            wait_ptr = st.events.get(wait_event) if wait_event else 0
            copier = self._copier(st.device)
            try:
                return copier.run(desc, self.method, wait_event_ptr=wait_ptr, timeout_s=self.copy_timeout_s)
            finally:
                if copier.broken:
                    self._abandon(copier)
        finally:
            with st.lock:
                st.inflight -= 1
                release_now = st.detaching and st.inflight == 0 and not st.released
                if release_now:
                    st.released = True
            if release_now:
                _release(st)

    def _copier(self, device: int) -> BatchCopier:
        copiers: dict[int, BatchCopier] | None = getattr(self._local, "copiers", None)
        if copiers is None:
            copiers = self._local.copiers = {}
        c = copiers.get(device)
        if c is None or c.broken:
            c = BatchCopier(device, threads_per_block=self._tpb, chunk_bytes=self._chunk)
            copiers[device] = c
            with self._lock:
                self._copiers.append(c)
        return c

    def _abandon(self, copier: BatchCopier) -> None:
        with self._lock:
            if copier in self._copiers:
                self._copiers.remove(copier)
            self._abandoned.append(copier)  # kept alive: the GPU may still use its buffers

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            attached = list(self._attached)
            copiers, self._copiers = self._copiers, []
        for att in attached:
            self.detach(att)
        for c in copiers:
            c.events.close()
        if self._pinned is not None:
            self._pinned.close()
