"""CUDA IPC events: cross-process stream ordering without host synchronisation on the engine.

Role
    Store: at the end of a step the shim records an interprocess event on the engine's stream
    (``IpcEventRing.record``) and sends its 64-byte handle with the step's offers; the daemon
    opens it (``OpenedEvents``) and makes its copy stream wait on it before reading, so the
    copy sees exactly the bytes the step wrote (this is what keeps a Mamba snapshot exact).
    Retrieve: the daemon records its own interprocess event after writing and returns the
    handle; the shim calls ``OpenedEvents.wait(engine_stream, handle)`` before the forward that
    reads those blocks. Neither side ever blocks the engine's host thread: recording, opening
    a cached handle and ``cudaStreamWaitEvent`` are all asynchronous.

Why a ring
    An IPC handle names an event object, not one recording of it; ``cudaStreamWaitEvent`` waits
    for whatever recording is the latest when it is called. Re-recording one event every step
    would make a late waiter wait on a *later* step (safe but slower), so a ring of ``size``
    events is recorded round-robin; with copies invalid after step s+2 (design: snapshots), 8
    is ample. A handle is fixed per event, so the receiving side opens each one once.

Threading
    ``IpcEventRing`` is not thread-safe: one per recording stream, used under its owner's lock
    (the shim's worker thread; each of the daemon's copy lanes, ``hkvd.cuda.copy``). Nothing
    here waits on the host: the daemon observes its own copies' completion with host functions
    (``hkvd.cuda.completion``), and ``event_done`` is one non-blocking query. ``OpenedEvents``
    guards its cache with a lock and may be shared by copy threads. Every CUDA call runs with the
    ring's / cache's device current.

Lifecycle
    Rings and caches own CUDA events; ``close()`` (idempotent) destroys them. An opened IPC
    event must be destroyed before the exporter destroys its event (detach does it).
"""

from __future__ import annotations

import logging
import threading

from hkvd.cuda._cupy import CUDA_ERROR_NOT_READY, CUDA_SUCCESS, cupy, runtime, status_of
from hkvd.cuda.ipc import IPC_HANDLE_BYTES

logger = logging.getLogger(__name__)

CUDA_EVENT_DISABLE_TIMING = 0x2  # driver_types.h cudaEventDisableTiming
CUDA_EVENT_INTERPROCESS = 0x4  # cudaEventInterprocess (requires DisableTiming)
IPC_EVENT_FLAGS = CUDA_EVENT_INTERPROCESS | CUDA_EVENT_DISABLE_TIMING
DEFAULT_RING_SIZE = 8


def check_event_handle(handle: bytes) -> None:
    if not isinstance(handle, bytes | bytearray) or len(handle) != IPC_HANDLE_BYTES:
        got = len(handle) if isinstance(handle, bytes | bytearray) else type(handle).__name__
        raise ValueError(f"a CUDA IPC event handle is {IPC_HANDLE_BYTES} bytes, got {got}")


def event_done(event_ptr: int) -> bool:
    """``cudaEventQuery``: True once every recorded op before the event has completed."""
    rt = runtime()
    try:
        status = rt.eventQuery(event_ptr)
    except Exception as e:
        if status_of(e) == CUDA_ERROR_NOT_READY:
            return False
        raise
    if status == CUDA_SUCCESS:
        return True
    if status == CUDA_ERROR_NOT_READY:
        return False
    raise RuntimeError(f"cudaEventQuery returned {status}")


def _destroy_events(device: int, events: list[int], what: str) -> None:
    """Destroy ``events`` on ``device``; a failure is logged, never raised (close() must finish)."""
    if not events:
        return
    try:
        rt = runtime()
        with cupy().cuda.Device(device):
            for ev in events:
                rt.eventDestroy(ev)
    except Exception:
        logger.warning("destroying %s on device %d failed", what, device, exc_info=True)

class IpcEventRing:
    """``size`` interprocess events on ``device``, recorded round-robin. See the module docstring."""

    def __init__(self, device: int, size: int = DEFAULT_RING_SIZE) -> None:
        if size <= 0:
            raise ValueError(f"ring size must be positive, got {size}")
        rt = runtime()
        self.device = device
        self._events: list[int] = []
        self._handles: list[bytes] = []
        with cupy().cuda.Device(device):
            try:
                for _ in range(size):
                    ev = int(rt.eventCreateWithFlags(IPC_EVENT_FLAGS))
                    self._events.append(ev)
                    self._handles.append(bytes(rt.ipcGetEventHandle(ev)))
            except Exception:
                self.close()
                raise
        self._next = 0

    def record(self, stream_ptr: int) -> tuple[int, bytes]:
        """Record the next event on ``stream_ptr``; return (local event pointer, IPC handle)."""
        if not self._events:
            raise RuntimeError("IpcEventRing is closed")
        i = self._next
        self._next = (i + 1) % len(self._events)
        with cupy().cuda.Device(self.device):
            runtime().eventRecord(self._events[i], stream_ptr)
        return self._events[i], self._handles[i]

    def close(self) -> None:
        events, self._events, self._handles = self._events, [], []
        _destroy_events(self.device, events, "IPC events")


class OpenedEvents:
    """Handle -> event opened with ``cudaIpcOpenEventHandle`` on ``device``, once each."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._open: dict[bytes, int] = {}
        self._closed = False

    def get(self, handle: bytes) -> int:
        check_event_handle(handle)
        key = bytes(handle)
        with self._lock:
            if self._closed:
                raise RuntimeError("OpenedEvents is closed")
            ev = self._open.get(key)
            if ev is None:
                with cupy().cuda.Device(self.device):
                    ev = int(runtime().ipcOpenEventHandle(key))
                self._open[key] = ev
            return ev

    def wait(self, stream_ptr: int, handle: bytes) -> None:
        """Make ``stream_ptr`` wait for the latest recording of ``handle``'s event. No host sync."""
        ev = self.get(handle)
        with cupy().cuda.Device(self.device):
            runtime().streamWaitEvent(stream_ptr, ev, 0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            events, self._open = list(self._open.values()), {}
        _destroy_events(self.device, events, "opened IPC events")
