"""CUDA copy engine: copies between IPC-opened GPU memory and the pinned pool, enqueued, never polled.

Role
    ``CudaCopyEngine`` implements ``hkvd.transport.copy_engine.CopyEngine`` for regions of kind
    "cuda". ``attach`` matches the engine's GPU by UUID and opens its IPC handles once per
    process (``hkvd.cuda.ipc``); a copy turns segments into coalesced ``(src, dst, nbytes)``
    descriptors (``hkvd.cuda.descriptors``) and moves them by
    - ``method="memcpy"``: the GPU's DMA copy engines: the whole request as one
      ``cudaMemcpyBatchAsync`` where CUDA is 12.8+ and cuda-bindings is installed, else one
      ``cudaMemcpyAsync`` per row (``hkvd.cuda.dma``); or
    - ``method="kernel"``: one launch of a gather/scatter kernel on the SMs. Block (x, y) copies
      64 KiB chunks y, y+gridDim.y, ... of row x, 16 bytes per thread per load when both ends
      are 16-byte aligned; or
    - ``method="auto"`` (the default): per request, the kernel only for many tiny rows
      (``choose_method``), DMA otherwise.
    DMA is the default because, measured on an H200 (2026-11), a compute engine's steps took
    1.53x at p50 while the kernel copied and 1.05x while DMA copied: without MPS, kernels of
    two processes time-slice the SMs, and the copy engines are separate hardware.

Ordering
    Each attachment has its own lanes: one for stores, one for retrieves, so both directions run
    at once. A lane has a copy stream (copies, each followed by one of the lane's interprocess
    events, whose handle is the copy's ``done_event``, and a host function that tells the
    completion thread, ``hkvd.cuda.completion``, that the GPU got there) and a gate stream. A
    copy without ``wait_event`` is enqueued on the copy stream at once. A store that carries the
    engine's step-end IPC event is gated: the gate stream waits on the event
    (``cudaStreamWaitEvent``, no host poll) and then runs a host function; when it fires (the
    step ended), the completion thread enqueues the copy on the copy stream, behind a
    ``cudaStreamWaitEvent`` on that event again (complete by then: ordering by construction, at
    no cost). No copy ever sits on a stream behind an engine's event, so a copy whose engine
    never finishes its step is never enqueued and can never run late. ``submit`` returns at
    once; ``copy_ordered`` waits for the host-side completion (what a store needs before its
    entry becomes visible, and what keeps a retrieve's pool pages pinned until the GPU read them).

Threading
    ``attach``/``detach``/``abandon`` run on the event loop (an IPC open maps an allocation: ~ms).
    ``submit`` runs on any copy thread and holds the lane's lock only while enqueueing, so
    requests of several threads, and several requests of one thread, are in flight at once
    (on one lane they queue in stream order on the GPU). Waiting is on a ``threading.Event``
    that the completion thread sets: no thread spins or sleep-polls a CUDA event.

Failure
    Out-of-range segments raise ``CopyFailedError`` before anything is enqueued. Every copy has
    a budget of ``copy_timeout_s`` from submission, the wait for the step-end event included:
    past it the copy fails with ``KVTimeout`` (``CopyFailedError`` when its done event reports a
    CUDA error) and nothing of it is reported stored.
    - Still behind its gate (a wedged or dead engine): the copy is never enqueued, nothing of it
      reads the engine's memory or writes the pool; its pages and its share of the mappings are
      free at once. The gate stream is retired (kept referenced, never used again); later copies
      get a fresh one.
    - Already enqueued (the GPU is slow): its copy stream is retired the same way, and its error
      carries ``PagesInUse`` (``hkvd.transport.errors``): its pool pages, and the mappings it
      reads, stay in use until the GPU finished it (its host function ran). After a CUDA fault
      host functions never run, so they stay held; faults are sticky for the context and the
      daemon should then stop using the device.
    ``abandon(attachment)`` ("the engine process is gone") fails every unfinished copy of that
    engine at once with ``CopyFailedError`` by the same rules and retires its lanes; ``detach``
    releases the IPC mappings once no copy that may still run uses them (at once when every copy
    was still behind its gate).

Lifecycle
    Build once at daemon start (registers the pool: ``hkvd.cuda.hostreg``), ``close()`` once at
    shutdown after the copy threads have drained (it fails what is still pending, detaches what
    is still attached, then unregisters the pool).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hkvd.cuda import dma
from hkvd.cuda._cupy import CUDA_ERROR_NOT_READY, cupy, runtime, status_of
from hkvd.cuda.completion import CompletionWatcher, CopyTicket, LaunchFailed
from hkvd.cuda.descriptors import (
    DEFAULT_CHUNK_BYTES,
    LEN,
    build_descriptors,
    coalesce,
    launch_geometry,
    total_bytes,
)
from hkvd.cuda.hostreg import MAX_REGISTER_BYTES, PinnedRegistration, PoolLike
from hkvd.cuda.ipc import REGISTRY, check_region_fields, match_device, visible_device_uuids
from hkvd.cuda.ipc_events import IpcEventRing, OpenedEvents
from hkvd.transport.copy_engine import Attachment, CopyEngine, CopyResult, Direction, EngineProcess, Region, Segment
from hkvd.transport.errors import CopyFailedError, KVError, RegistrationError

logger = logging.getLogger(__name__)

METHODS = ("auto", "memcpy", "kernel")
DEFAULT_METHOD = "auto"
# auto picks the kernel only for requests of at least this many rows whose mean row is at most
# AUTO_KERNEL_MAX_ROW_BYTES: there each DMA row pays a fixed cost (~2-4 us of CPU per
# cudaMemcpyAsync; bench/gpu_copy.py on an H100 saw per-row memcpy at 0.31 of pinned cudaMemcpy
# for 64 KiB pages against 0.94 for the kernel) while one launch moves them all. Neither bound is
# measured as a crossover, with cudaMemcpyBatchAsync or against an engine's step times: they are
# set so that KV pages of 64 KiB and more (every layout the daemon saw) go to the copy engines,
# which is what kept a compute engine's steps at 1.05x (H200, 2026-11). bench/gpu_interference.py
# measures both methods; move the bounds with its figures.
AUTO_KERNEL_MIN_ROWS = 4096
AUTO_KERNEL_MAX_ROW_BYTES = 16 << 10
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
            compile_fn = getattr(_kernel, "compile", None)
            if compile_fn is not None:
                compile_fn()  # surface nvrtc problems now, not in the middle of a copy
        return _kernel


def check_method(method: str) -> str:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return method


def choose_method(desc: np.ndarray, method: str, *, kernel_ok: bool = True) -> str:
    """The path one request takes: ``method`` unless it is "auto" (see ``AUTO_KERNEL_MIN_ROWS``)."""
    if method != "auto":
        return method
    n = int(desc.shape[0])
    if kernel_ok and n >= AUTO_KERNEL_MIN_ROWS and int(desc[:, LEN].sum()) <= n * AUTO_KERNEL_MAX_ROW_BYTES:
        return "kernel"
    return "memcpy"


def enqueue_copy(desc: np.ndarray, method: str, stream: Any, *, batch: dma.BatchApi | None,
                 threads_per_block: int = DEFAULT_THREADS_PER_BLOCK,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> object:
    """Enqueue every row of ``desc`` on ``stream`` (a CuPy stream; the device is current) and return
    what the GPU reads later and must stay referenced until it finished (kernel descriptors), or None."""
    if desc.shape[0] == 0:
        return None
    rt = runtime()
    if method == "memcpy":
        dma.enqueue_dma(rt, desc, stream.ptr, batch)
        return None
    if method != "kernel":
        raise ValueError(f"no copy path {method!r}")
    cp = cupy()
    geo = launch_geometry(desc, chunk_bytes)
    n = geo.grid_x
    # Fresh staging per request (CuPy's pools make this cheap): a request in flight keeps its own.
    host_mem = cp.cuda.alloc_pinned_memory(n * 24)
    np.frombuffer(host_mem, dtype=np.int64, count=n * 3).reshape(n, 3)[:] = desc
    dev = cp.empty(n * 3, dtype=cp.int64)
    rt.memcpyAsync(dev.data.ptr, host_mem.ptr, n * 24, rt.memcpyHostToDevice, stream.ptr)
    _get_kernel()((geo.grid_x, geo.grid_y), (threads_per_block,), (dev, np.int64(geo.chunk_bytes)), stream=stream)
    return (host_mem, dev)


def event_error(event_ptr: int) -> str | None:
    """One ``cudaEventQuery``: the error it reports, or None (complete or not ready)."""
    try:
        runtime().eventQuery(event_ptr)
    except Exception as e:
        if status_of(e) == CUDA_ERROR_NOT_READY:
            return None
        return str(e)
    return None


class BatchCopier:
    """A stream of its own and a blocking ``run``: what ``bench/gpu_copy.py`` measures (the daemon
    uses ``CudaCopyEngine``). Not thread-safe."""

    def __init__(self, device: int, *, threads_per_block: int = DEFAULT_THREADS_PER_BLOCK,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        cp = cupy()
        self.device = device
        self.threads_per_block = threads_per_block
        self.chunk_bytes = chunk_bytes
        self.batch = dma.batch_api()
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.events = IpcEventRing(device)

    def run(self, desc: np.ndarray, method: str) -> CopyResult:
        cp = cupy()
        with cp.cuda.Device(self.device):
            keep = enqueue_copy(desc, choose_method(desc, check_method(method)), self.stream, batch=self.batch,
                                threads_per_block=self.threads_per_block, chunk_bytes=self.chunk_bytes)
            _, handle = self.events.record(self.stream.ptr)
            self.stream.synchronize()
        del keep
        return CopyResult(total_bytes(desc), handle)


class _Lane:
    """One attachment's copies in one direction: a copy stream with its done-event ring, and a gate
    stream where step-end events are awaited. Guarded by ``lock``; ``gate`` is replaced (the old one
    retired) when a copy timed out waiting on it."""

    def __init__(self, device: int, label: str) -> None:
        cp = cupy()
        self.device = device
        self.label = label
        self.lock = threading.Lock()
        self.broken = False
        with cp.cuda.Device(device):
            self.stream = cp.cuda.Stream(non_blocking=True)
            self.gate = cp.cuda.Stream(non_blocking=True)
            self.events = IpcEventRing(device)


@dataclass(slots=True)
class _CudaState:
    """Per attachment; guarded by ``lock``. Mappings are released by whoever drops the last user."""

    device: int
    bases: dict[int, int]
    sizes: dict[int, int]
    handles: list[bytes]
    events: OpenedEvents
    kernel_ok: bool = True
    lock: threading.Lock = field(default_factory=threading.Lock)
    lanes: dict[Direction, _Lane] = field(default_factory=dict)
    tickets: set[CopyTicket] = field(default_factory=set)
    inflight: int = 0
    detaching: bool = False
    abandoned: bool = False
    released: bool = False


def _release(st: _CudaState) -> None:
    st.events.close()
    for h in st.handles:
        REGISTRY.release(h)


class CudaCopyEngine(CopyEngine):
    """Copy engine for "cuda" regions. See the module docstring.

    ``pool`` needs ``base_addr`` and ``size`` (a ``HugePagePool``); it is registered as pinned
    here unless ``register_pool=False`` (the caller then guarantees it is registered), in registrations of
    at most ``pin_chunk_bytes`` (copies are split at their boundaries: ``hkvd.cuda.descriptors.split_at``).
    """

    name = "cuda"
    enqueues = True  # submit() returns once the copy is enqueued (hkvd.cuda.completion settles it)

    def __init__(
        self,
        pool: PoolLike,
        *,
        method: str = DEFAULT_METHOD,
        copy_timeout_s: float = DEFAULT_COPY_TIMEOUT_S,
        threads_per_block: int = DEFAULT_THREADS_PER_BLOCK,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        register_pool: bool = True,
        pin_chunk_bytes: int = MAX_REGISTER_BYTES,
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
        self._batch = dma.batch_api() if method != "kernel" else None
        if self._batch is None and method != "kernel":
            logger.info("CUDA DMA copies go one cudaMemcpyAsync per row: %s", dma.batch_api_reason())
        self._pinned = (PinnedRegistration.for_pool(pool, max_chunk_bytes=pin_chunk_bytes) if register_pool
                        else None)
        # Pool offsets where one pinned registration ends (pools past the driver's cap): no row spans one.
        self._boundaries = self._pinned.boundaries if self._pinned is not None else ()
        self._lock = threading.Lock()
        self._lanes: list[_Lane] = []
        self._retired: list[object] = []  # lanes and gate streams never used again: the GPU may still use them
        self._attached: list[Attachment] = []
        self._closed = False
        self._watcher = CompletionWatcher(event_error)

    # -- attach / detach / abandon (event loop) ---------------------------------------------

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
        kernel_ok = self.method != "memcpy" and self._kernel_can_reach_pool(device)
        if self.method == "kernel" and not kernel_ok:
            raise RegistrationError(
                f"GPU {device} cannot use registered host pointers directly, so the copy kernel cannot "
                "reach the pool; start hkvd serve with --cuda-copy-method memcpy (or auto)"
            )
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
            kernel_ok=kernel_ok,
        )
        att = Attachment(pid=pid, regions=by_id, state={"cuda": st})
        with self._lock:
            self._attached.append(att)
        return att

    def _kernel_can_reach_pool(self, device: int) -> bool:
        rt = runtime()
        return bool(rt.deviceGetAttribute(rt.cudaDevAttrCanUseHostPointerForRegisteredMem, device))

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

    def abandon(self, attachment: Attachment) -> None:
        """The engine process is gone: fail its unfinished copies now and never reuse their streams.
        A copy still behind its gate is never enqueued; one already enqueued holds its pages and the
        mappings until the GPU finished it."""
        st: _CudaState | None = attachment.state.get("cuda")
        if st is None:
            return
        with st.lock:
            st.abandoned = True
            tickets = list(st.tickets)
            lanes = list(st.lanes.values())
            st.lanes.clear()
        for lane in lanes:
            self._retire(lane)
        err = f"engine pid {attachment.pid} is gone; its copy was abandoned"
        for t in tickets:
            t.settle(CopyFailedError(f"{t.what}: {err}"))

    # -- copies (copy threads) --------------------------------------------------------------

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
        """``submit``, then wait for the host-side completion (within the copy budget)."""
        return self.submit(attachment, segments, direction, wait_event=wait_event).wait()

    def submit(
        self,
        attachment: Attachment,
        segments: list[Segment],
        direction: Direction,
        *,
        wait_event: bytes | None = None,
    ) -> CopyTicket:
        """Enqueue the copy, or gate it on ``wait_event`` (the engine's step-end event), and return at once.

        Without ``wait_event`` the copy is enqueued before this returns and ``ticket.result.done_event``
        may go to the engine at once (its stream waits on it). With it, the copy is enqueued by the
        completion thread when the event completed (``_gate``); ``result.done_event`` is set then. The
        pool side of the copy is final only once the ticket settled without an exception (``wait`` /
        ``add_done_callback``): a store's entry must not become visible, and a retrieve's pool pages
        must stay pinned, until then; after a failure, until ``PagesInUse.of(exc)`` says they are free.
        """
        st: _CudaState | None = attachment.state.get("cuda")
        if st is None:
            raise CopyFailedError("attachment was not made by the cuda copy engine")
        desc = self._descriptors(st, segments, direction)
        deadline = time.monotonic() + self.copy_timeout_s
        self._take_user(st, attachment.pid)
        try:
            wait_ptr = st.events.get(wait_event) if wait_event else 0
            lane = self._lane(st, direction)
            method = choose_method(desc, self.method, kernel_ok=st.kernel_ok)
            what = f"a {int(desc.shape[0])}-row {direction.value} copy ({method}) on device {st.device}"
            ticket = CopyTicket(total_bytes(desc), b"", deadline=deadline, what=what, owner=lane,
                                launch=functools.partial(self._launch, st, direction, desc, method, wait_ptr))
        except BaseException:
            self._drop_user(st)
            raise
        # From here the ticket holds the mappings' user until the GPU is done with it (or never starts).
        ticket.add_finished_callback(lambda t: self._drop_user(st))
        ticket.add_done_callback(lambda t: self._settled(st, t))
        with st.lock:
            st.tickets.add(ticket)
            gone = st.abandoned  # abandon() ran meanwhile
        if gone:
            ticket.settle(CopyFailedError(f"{what}: the engine is gone; its copy was abandoned"))
            return ticket
        try:
            self._watcher.watch(ticket)
        except KVError as e:
            ticket.settle(e)
            raise
        if wait_ptr:
            self._gate(st, direction, lane, ticket, wait_ptr)
        else:
            ticket.open_gate()
            exc = ticket.exception()
            if exc is not None:
                raise exc
        return ticket

    def _descriptors(self, st: _CudaState, segments: list[Segment], direction: Direction) -> np.ndarray:
        """The copy's descriptor rows, checked against the engine's regions and the pool, coalesced."""
        return coalesce(
            build_descriptors(
                segments,
                direction,
                region_bases=st.bases,
                region_sizes=st.sizes,
                pool_base=self._pool_base,
                pool_size=self._pool_size,
            ),
            direction,
            pool_base=self._pool_base,
            boundaries=self._boundaries,
        )

    def _take_user(self, st: _CudaState, pid: int) -> None:
        """Count one more user of the mappings; refused once the engine was abandoned or detached."""
        with st.lock:
            if st.abandoned:
                raise CopyFailedError(f"engine pid {pid} is gone; its copies are abandoned")
            if st.detaching:
                raise CopyFailedError(f"engine pid {pid} was detached")
            st.inflight += 1

    def _gate(self, st: _CudaState, direction: Direction, lane: _Lane, ticket: CopyTicket, wait_ptr: int) -> None:
        """Gate ``ticket`` on the engine's event: the lane's gate stream waits on it, then a host function
        hands the ticket to the completion thread, which enqueues the copy (``CopyTicket.open_gate``)."""
        rt = runtime()
        err: Exception | None = None
        for _ in range(3):
            if lane.broken:
                lane = self._lane(st, direction)
            with lane.lock:
                if lane.broken:
                    continue
                gate = lane.gate
                ticket.owner = (lane, gate)
                try:
                    with cupy().cuda.Device(st.device):
                        rt.streamWaitEvent(gate.ptr, wait_ptr, 0)  # the GPU waits; no host poll
                        gate.launch_host_func(self._watcher.gate_opened, ticket)
                    return
                except Exception as e:
                    err = e
                break
        if err is not None:
            self._retire_gate(lane, ticket.owner[1])
            exc = CopyFailedError(f"{ticket.what}: waiting on the engine's step-end event failed: {err}")
        else:
            exc = CopyFailedError(f"{ticket.what}: its streams were abandoned meanwhile; retry")
        ticket.settle(exc)  # nothing of it is enqueued: nothing is held
        raise exc

    def _launch(self, st: _CudaState, direction: Direction, desc: np.ndarray, method: str, wait_ptr: int,
                ticket: CopyTicket) -> tuple[CopyResult, int, object]:
        """Enqueue the copy on the lane's copy stream, its done event and host function (the ticket's
        launch: on the submitting thread, or the completion thread once the gate opened)."""
        cp = cupy()
        rt = runtime()
        what = ticket.what
        for _ in range(3):
            try:
                lane = self._lane(st, direction)
            except Exception as e:
                raise LaunchFailed(CopyFailedError(f"{what}: no stream for it: {e}"), enqueued=False) from e
            with lane.lock:
                if lane.broken:
                    continue
                ticket.owner = lane
                stage = "wait"
                try:
                    with cp.cuda.Device(st.device):
                        if wait_ptr:
                            # Complete already (the gate saw it): ordering by construction, at no cost.
                            rt.streamWaitEvent(lane.stream.ptr, wait_ptr, 0)
                        stage = "copy"
                        keep = enqueue_copy(desc, method, lane.stream, batch=self._batch,
                                            threads_per_block=self._tpb, chunk_bytes=self._chunk)
                        ev, handle = lane.events.record(lane.stream.ptr)
                        lane.stream.launch_host_func(self._watcher.gpu_reached, ticket)
                except Exception as e:
                    self._retire(lane)  # rows may be enqueued: the stream is not reused
                    err = e if isinstance(e, KVError) else CopyFailedError(f"{what}: enqueueing failed: {e}")
                    if stage == "wait":
                        raise LaunchFailed(err, enqueued=False) from e
                    try:  # the GPU may run what was enqueued: free its pages once it passed
                        lane.stream.launch_host_func(self._watcher.gpu_reached, ticket)
                    except Exception:
                        logger.warning("%s: its pool pages stay held (no host function after a failed enqueue)",
                                       what, exc_info=True)
                    raise LaunchFailed(err, enqueued=True) from e
            return CopyResult(ticket.result.nbytes, handle), ev, keep
        raise LaunchFailed(CopyFailedError(f"{what}: its stream was abandoned meanwhile; retry"), enqueued=False)

    def _lane(self, st: _CudaState, direction: Direction) -> _Lane:
        with st.lock:
            lane = st.lanes.get(direction)
        if lane is None or lane.broken:
            made = _Lane(st.device, direction.value)  # two streams and 8 IPC events: outside the lock
            with st.lock:
                lane = st.lanes.get(direction)
                if lane is None or lane.broken:
                    st.lanes[direction] = lane = made
            if lane is not made:
                made.events.close()  # another thread made one meanwhile
            else:
                with self._lock:
                    self._lanes.append(lane)
        return lane

    def _retire(self, lane: _Lane) -> None:
        """Never use ``lane`` again; keep it (its streams, events) referenced: the GPU may still run it."""
        lane.broken = True
        with self._lock:
            if lane in self._lanes:
                self._lanes.remove(lane)
                self._retired.append(lane)

    def _retire_gate(self, lane: _Lane, gate: Any) -> None:
        """A copy gave up waiting on ``gate`` (a wedged event): its later copies get a fresh gate stream;
        the old one stays referenced and is never used again."""
        with lane.lock:
            if lane.broken or lane.gate is not gate:
                return  # the lane is retired whole, or the gate was replaced already
            try:
                with cupy().cuda.Device(lane.device):
                    lane.gate = cupy().cuda.Stream(non_blocking=True)
            except Exception:
                logger.warning("no fresh gate stream on device %d; the lane is retired", lane.device, exc_info=True)
                lane.broken = True
        with self._lock:
            self._retired.append(gate)
            if lane.broken and lane in self._lanes:
                self._lanes.remove(lane)
                self._retired.append(lane)

    def _settled(self, st: _CudaState, ticket: CopyTicket) -> None:
        with st.lock:
            st.tickets.discard(ticket)
        if ticket.exception() is None:
            return
        owner = ticket.owner
        if isinstance(owner, _Lane):
            if ticket.enqueued:
                self._retire(owner)  # the GPU may still run it: the stream is not reused
        elif isinstance(owner, tuple):
            self._retire_gate(*owner)  # it never left the gate, which may be wedged

    def _drop_user(self, st: _CudaState) -> None:
        with st.lock:
            st.inflight -= 1
            release_now = st.detaching and st.inflight == 0 and not st.released
            if release_now:
                st.released = True
        if release_now:
            _release(st)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            attached = list(self._attached)
        self._watcher.close()  # fails what is still pending: every user of a mapping is dropped
        for att in attached:
            self.detach(att)
        with self._lock:
            lanes, self._lanes = self._lanes, []
        for lane in lanes:
            lane.events.close()
        if self._pinned is not None:
            self._pinned.close()
